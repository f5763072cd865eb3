"""One interface per engine backend, chosen by the spec's `backend` from a registry.

`build-engines` and the repository renderer talk to a backend only through `EngineBackend`; the
registry names each implementation by module path and imports it on first use (as vLLM's KV connector
factory does), so this module knows no backend and the backends know only this module and
`disagg.repository`: the arrows point one way.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from disagg.repository import Model
from disagg.spec import DeploymentSpec


class EngineBackend(ABC):
    """What one engine backend does for a deployment spec."""

    def prepare(self, spec: DeploymentSpec) -> DeploymentSpec:
        """The spec as this build machine decides it (e.g. the installed release); called before a build."""
        return spec

    @abstractmethod
    def build_roles(self, spec: DeploymentSpec, roles: list[str], force: bool, log: Callable[[str], None]) -> list[str]:
        """Builds the roles' engines that are not up to date (all with `force`); returns those rebuilt."""

    @abstractmethod
    def dry_run_lines(self, spec: DeploymentSpec, roles: list[str]) -> list[str]:
        """What `build_roles` would do, one line per step; every spec error is raised here first."""

    @abstractmethod
    def engine_models(self, spec: DeploymentSpec) -> list[Model]:
        """The engine models of the repository (one per prefill/decode instance, see role_models)."""

    def engine_input_names(self, spec: DeploymentSpec) -> dict[str, str]:
        """Inputs the engines read under older names than the newest ones the orchestrator uses."""
        return {}

    def extra_files(self, spec: DeploymentSpec, models: list[str]) -> dict[Path, str]:
        """Files beside the repository (path relative to its parent directory), given every model's name."""
        return {}


_REGISTRY = {
    "reference": ("disagg.build.reference", "ReferenceBackend"),
    "tensorrt_llm": ("disagg.trtllm.backend", "TensorRTLLMBackend"),
}


def backend_for(spec: DeploymentSpec) -> EngineBackend:
    module, name = _REGISTRY[spec.backend]
    return getattr(importlib.import_module(module), name)()
