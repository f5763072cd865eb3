"""Model parameters and the repository-relative paths they hold.

Rendered configs keep paths relative to the model repository directory (`../build/engines/prefill`) so
the committed repository works from any checkout. The Python backend passes each model its own directory
as `args["model_repository"]` (`<repository>/prefill`, relative to the server's working directory when the
server was given a relative repository), so the repository root is its parent.
"""
from __future__ import annotations

import json
from pathlib import Path


def model_param(args: dict, key: str) -> str:
    """The string value of parameter `key` in the model's config.pbtxt; a clear error when absent."""
    config = json.loads(args["model_config"])
    try:
        return config["parameters"][key]["string_value"]
    except KeyError:
        raise ValueError(f"model {config.get('name')!r}: parameter {key!r} is missing from its config.pbtxt") from None


def repository_root(args: dict) -> Path:
    return Path(args["model_repository"]).parent


def resolve_path(args: dict, key: str) -> Path:
    """The path held by parameter `key`, resolved against the repository root; it must exist."""
    value = model_param(args, key)
    path = (repository_root(args) / value).resolve()  # an absolute value stays as it is
    if not path.exists():
        name = json.loads(args["model_config"]).get("name")
        raise FileNotFoundError(
            f"model {name!r}: parameter {key}={value!r} points to {path}, which does not exist "
            f"(relative paths are relative to the model repository {repository_root(args)})"
        )
    return path
