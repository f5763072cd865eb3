"""The pieces every part of a model repository is made of: model names, templates, config checks.

Both engine backends and the repository renderer build on this module, and it on nothing of theirs, so
the dependency arrows point one way: cli -> render -> backend implementations -> repository -> spec.
"""
from __future__ import annotations

import functools
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.spec import DeploymentSpec
from disagg.triton.text_contract import TEMPLATE_NAMES

TEMPLATE_DIRS = [Path(__file__).resolve().parent.parent / "templates" / kind for kind in ("python", "tensorrtllm", "k8s")]
# Role name -> engine model name; "aggregated" is taken by the baseline's public ensemble.
ENGINE_MODELS = {"prefill": "prefill", "decode": "decode", "aggregated": "aggregated_engine"}


def role_models(spec: DeploymentSpec, role: str) -> list[str]:
    """The engine models that serve `role`. Prefill and decode get one model per instance (`decode`,
    `decode_1`, ...), on either backend: a `stop` acts only on the instance Triton routes it to (the
    tensorrtllm backend cancels within its own instance), so the orchestrator must be able to name the
    instance that holds a request's KV, and it picks the least loaded one itself. The aggregated baseline
    keeps one model of `instances` instances: its requests are cancelled through their own streams."""
    model = ENGINE_MODELS[role]
    if role == "aggregated":
        return [model]
    return [model] + [f"{model}_{i}" for i in range(1, spec.roles[role].instances)]


class RenderError(ValueError):
    """A rendered file is invalid; the message names the model."""


@dataclass(frozen=True)
class Model:
    """One model directory: its config.pbtxt and, for Python models, the module its model.py imports."""

    name: str
    config: str
    module: str | None = None


def _pbstr(value: object) -> str:
    """A protobuf text-format string literal."""
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


@functools.cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIRS),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pbstr"] = _pbstr
    env.filters["shquote"] = shlex.quote
    env.globals.update(TEMPLATE_NAMES)
    return env


def write_changed(files: dict[Path, str]) -> list[Path]:
    """Writes each file whose content differs from what is there; returns those written. Nothing is deleted."""
    written = []
    for path, text in sorted(files.items()):
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def render_template(template: str, **context) -> str:
    """Renders one template; a variable the template uses but `context` lacks raises UndefinedError."""
    return environment().get_template(template).render(**context)


def python_model(name: str, template: str, module: str, **context) -> Model:
    """A Python model: its config rendered from `template`, its model.py importing `disagg.triton.<module>`."""
    return Model(name, render_template(template, name=name, **context), f"disagg.triton.{module}")


def instance_count(config: model_config_pb2.ModelConfig) -> int:
    """How many instances Triton runs of a model (an instance group without a count runs one)."""
    return sum(g.count or 1 for g in config.instance_group) or 1


def parse_config(model: str, text: str) -> model_config_pb2.ModelConfig:
    """Parses `text` as Triton's ModelConfig; RenderError names the model on any problem."""
    if "${" in text:
        raise RenderError(f"model {model!r}: config.pbtxt has an unfilled ${{...}} placeholder")
    try:
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise RenderError(f"model {model!r}: config.pbtxt is not a valid Triton ModelConfig: {exc}") from exc
    if config.name != model:
        raise RenderError(f"model {model!r}: config.pbtxt names the model {config.name!r}")
    return config


def repo_relative(spec: DeploymentSpec, path: Path) -> str:
    """`path` (relative to the project root, or absolute) as seen from the served repository directory
    `spec.model_repository`; absolute paths stay absolute."""
    if path.is_absolute():
        return str(path)
    return os.path.relpath(os.path.abspath(path), os.path.abspath(spec.model_repository))
