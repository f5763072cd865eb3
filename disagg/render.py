"""Renders the Triton model repository of a deployment from the jinja2 templates in templates/python/.

The default deployment's repository is committed (model_repository/) and a test re-renders and diffs it,
so the output is deterministic and machine-independent: parameters hold paths relative to the repository
directory (`../build/engines/prefill`), which disagg.triton.paths resolves when a model loads. Every
config.pbtxt is parsed into Triton's own ModelConfig protobuf before anything is written.

Models (reference backend; a `tensorrt_llm` spec gets the same front and tensorrtllm engine configs):
    preprocessing -> disagg_orchestrator -> postprocessing       = ensemble    (prefill + decode)
    preprocessing -> aggregated_orchestrator -> postprocessing   = aggregated  (aggregated_engine)
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import jinja2
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from disagg.build.reference import engine_dir
from disagg.spec import ROLES, DeploymentSpec
from disagg.triton.contract import ENGINE_GRPC_PORT

TEMPLATE_DIR = Path(__file__).resolve().parent.parent / "templates" / "python"

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
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
        autoescape=False,
    )
    env.filters["pbstr"] = _pbstr
    return env


def render_template(template: str, **context) -> str:
    """Renders one template; a variable the template uses but `context` lacks raises UndefinedError."""
    return environment().get_template(template).render(**context)


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


def _python_model(name: str, template: str, module: str, **context) -> Model:
    return Model(name, render_template(template, name=name, **context), f"disagg.triton.{module}")


def _front_models(spec: DeploymentSpec) -> list[Model]:
    """preprocessing and postprocessing. Their limits hold for every path behind them: prompts are checked
    against each role that reads prompts, output lengths against each role that generates."""
    prompt_roles = [r for name, r in spec.roles.items() if name != "decode"]
    output_roles = [r for name, r in spec.roles.items() if name != "prefill"]
    tokenizer_dir = repo_relative(spec, spec.model.path)
    batch = max(r.max_batch_size for r in spec.roles.values())
    return [
        _python_model(
            "preprocessing", "preprocessing.pbtxt.j2", "preprocessing", max_batch_size=batch,
            parameters={
                "tokenizer_dir": tokenizer_dir,
                "max_input_len": min(r.max_input_len for r in prompt_roles),
                "max_output_len": min(r.max_output_len for r in output_roles),
                "max_seq_len": min(r.max_seq_len for r in output_roles),
                "add_special_tokens": "true" if spec.model.add_special_tokens else "false",
            },
        ),
        _python_model(
            "postprocessing", "postprocessing.pbtxt.j2", "postprocessing", max_batch_size=batch,
            parameters={"tokenizer_dir": tokenizer_dir, "skip_special_tokens": "true"},
        ),
    ]


def _engine_models(spec: DeploymentSpec) -> list[Model]:
    if spec.backend == "tensorrt_llm":
        from disagg.trtllm.render import render_engine_configs

        return [Model(name, config) for role in spec.roles for name, config in render_engine_configs(spec, role).items()]
    kv = spec.kv_transfer
    models = []
    for role in spec.roles.values():
        names = role_models(spec, role.name)
        instances = role.instances if role.name == "aggregated" else 1
        for name in names:
            models.append(_python_model(
                name, "engine.pbtxt.j2", "engine_model", role=role, instances=instances,
                parameters={
                    "engine_dir": str(spec.engine_root / role.name) if spec.engine_root else repo_relative(spec, engine_dir(spec, role.name)),
                    "role": role.name,
                    "kv_transfer_backend": kv.backend,
                    "kv_lease_seconds": kv.lease_seconds,
                    "kv_bind_address": kv.bind_address,
                },
            ))
    return models


def engine_urls(spec: DeploymentSpec) -> str:
    """The orchestrator's `engine_urls`: engine models that another node's server serves. The front end
    runs with the first role's pool (see disagg.trtllm.render), every other pool at its standard port."""
    roles = [spec.roles[name] for name in ROLES if name in spec.roles]
    front = roles[0].node
    remote = []
    for role in roles:
        if role.node != front:
            remote += [f"{name}={role.node}:{ENGINE_GRPC_PORT}" for name in role_models(spec, role.name)]
    return ",".join(remote)


def engine_input_names(spec: DeploymentSpec) -> str:
    """The orchestrator's `engine_input_names`: inputs the spec's TensorRT-LLM release reads under older
    names ("seed=random_seed" for 0.17/0.18). The reference engine reads the newest names."""
    if spec.backend != "tensorrt_llm":
        return ""
    from disagg.trtllm.versions import release_of

    return ",".join(f"{new}={old}" for new, old in release_of(spec).input_names().items())


def _entry_models(spec: DeploymentSpec) -> list[Model]:
    """Orchestrator + ensemble per path; the baseline goes through exactly the same front."""
    o = spec.orchestrator
    batch = max(r.max_batch_size for r in spec.roles.values())
    common = {
        "prefill_timeout_s": o.prefill_timeout_s,
        "decode_timeout_s": o.decode_timeout_s,
        "max_in_flight": o.max_in_flight,
        "engine_urls": engine_urls(spec),
        "engine_input_names": engine_input_names(spec),
    }
    paths = []
    if spec.disaggregated:
        paths.append(("ensemble", "disagg_orchestrator", {
            "mode": "disaggregated", "context_model_name": ",".join(role_models(spec, "prefill")),
            "generation_model_name": ",".join(role_models(spec, "decode")),
        }))
    if "aggregated" in spec.roles:
        paths.append(("aggregated", "aggregated_orchestrator", {
            "mode": "aggregated", "aggregated_model_name": ENGINE_MODELS["aggregated"],
        }))
    models = []
    for ensemble, orchestrator, params in paths:
        models.append(_python_model(
            orchestrator, "orchestrator.pbtxt.j2", "orchestrator", max_batch_size=batch,
            instances=o.instances, parameters={**params, **common},
        ))
        models.append(Model(ensemble, render_template(
            "ensemble.pbtxt.j2", name=ensemble, orchestrator=orchestrator, max_batch_size=batch,
        )))
    return models


def plan_models(spec: DeploymentSpec) -> list[Model]:
    """Every model of the spec's repository, rendered and checked, nothing written."""
    models = _front_models(spec) + _engine_models(spec) + _entry_models(spec)
    for model in models:
        parse_config(model.name, model.config)
    return models


def _files(spec: DeploymentSpec, out_dir: Path) -> dict[Path, str]:
    files: dict[Path, str] = {}
    for model in plan_models(spec):
        files[out_dir / model.name / "config.pbtxt"] = model.config
        if model.module is None:
            files[out_dir / model.name / "1" / ".gitkeep"] = ""  # Triton needs the version directory
        else:
            shim = render_template("model.py.j2", name=model.name, module=model.module)
            files[out_dir / model.name / "1" / "model.py"] = shim
    if spec.backend == "tensorrt_llm":
        from disagg.trtllm.render import render_launch_script

        # Next to the repository, not in it: tritonserver would try to load a launch/ folder as a model.
        for name, text in render_launch_script(spec).items():
            files[out_dir.parent / "launch" / name] = text
    return files


def render_repository(spec: DeploymentSpec, out_dir: str | Path) -> list[Path]:
    """Renders the spec's model repository into `out_dir`.

    Paths inside are relative to `spec.model_repository` (where the repository is served from), whatever
    `out_dir` is, so a render into a scratch directory diffs clean against the committed one. A
    `tensorrt_llm` spec also gets its MPI launch files in `<out_dir>/../launch/`. Files are written only
    when their content changes; returns the paths written (empty: already up to date). Nothing is deleted.
    """
    written = []
    for path, text in sorted(_files(spec, Path(out_dir)).items()):
        if path.is_file() and path.read_text() == text:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
