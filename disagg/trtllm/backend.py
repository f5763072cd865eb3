"""TensorRT-LLM engines on GPUs behind the Triton `tensorrtllm` backend, as an `EngineBackend`."""
from __future__ import annotations

from pathlib import Path

from disagg.backend import EngineBackend
from disagg.repository import Model
from disagg.trtllm import build, versions
from disagg.trtllm.render import render_engine_configs, render_launch_script


class TensorRTLLMBackend(EngineBackend):
    """Per-role trtllm-build engines, `tensorrtllm` configs and the MPI launch script, for one release."""

    def prepare(self, spec):
        return build.pin_release(spec)

    def build_roles(self, spec, roles, force, log):
        return build.build_roles(spec, roles, force)

    def dry_run_lines(self, spec, roles):
        return build.dry_run_lines(spec, roles)

    def engine_models(self, spec) -> list[Model]:
        return [Model(name, config) for role in spec.roles for name, config in render_engine_configs(spec, role).items()]

    def engine_input_names(self, spec) -> dict[str, str]:
        return versions.release_of(spec).input_names()

    def extra_files(self, spec, models) -> dict[Path, str]:
        # Next to the repository, not in it: tritonserver would try to load a launch/ folder as a model.
        return {Path("launch") / name: text for name, text in render_launch_script(spec, models).items()}
