"""Shared fixtures: generated checkpoints, built deployments and real tritonservers.

No silent skips: a server that cannot start fails the test, with the last lines of its log.
"""
from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

import pytest

from disagg.checkpoint import generate_checkpoint
from disagg.serve.server import TritonServer

ROOT = Path(__file__).resolve().parent.parent

# Where configs put the generated checkpoint, relative to the project root (as in configs/cpu-tiny.yaml).
TINY_CHECKPOINT = Path("build/checkpoints/tiny-llama")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """The generated tiny Llama checkpoint (config.json, model.safetensors, tokenizer.json)."""
    return generate_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny-llama", "tiny")


@pytest.fixture(scope="session")
def start_triton(tmp_path_factory):
    """Factory: `start_triton(repo, *extra_args, **TritonServer_kwargs)` -> a ready TritonServer on free
    loopback ports, logging to a file. Stop it when done (`server.stop()`); any left running are stopped
    at the end of the session."""
    servers: list[TritonServer] = []

    def start(repo: Path, *extra_args: str, ready_timeout: float = 180.0, **kwargs) -> TritonServer:
        log = tmp_path_factory.mktemp("tritonserver") / "tritonserver.log"
        server = TritonServer(repo, extra_args=extra_args, log_path=log, **kwargs)
        servers.append(server)
        server.start()
        server.wait_ready(ready_timeout)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def new_project(tmp_path_factory, tiny_checkpoint):
    """Factory: `new_project(name)` -> a fresh scratch directory laid out like this project (configs/
    cpu-tiny.yaml, the generated checkpoint at its configured path), so every relative path in the spec
    holds inside it. Run spec-relative work under `contextlib.chdir(project)`."""

    def make(name: str = "project") -> Path:
        root = tmp_path_factory.mktemp(name)
        (root / "configs").mkdir()
        shutil.copy(ROOT / "configs" / "cpu-tiny.yaml", root / "configs" / "cpu-tiny.yaml")
        shutil.copytree(tiny_checkpoint, root / TINY_CHECKPOINT)
        return root

    return make


@pytest.fixture(scope="session")
def cpu_tiny_project(new_project) -> Path:
    """cpu-tiny built by `build-engines` (engines, rendered model_repository/) in a scratch project dir.
    Serve `<project>/model_repository`."""
    from disagg.cli import main

    project = new_project("cpu-tiny")
    with contextlib.chdir(project):  # spec paths are relative to the project root
        code = main(["--config", "configs/cpu-tiny.yaml"])
    assert code == 0, f"build-engines failed with exit code {code}"
    return project
