"""Per-role build commands: HF checkpoint -> TensorRT-LLM checkpoint -> TensorRT engine.

TP and PP are fixed at conversion time (one `rank{N}.safetensors` per rank), and `trtllm-build` bakes the
role's limits into the engine, so each role gets its own checkpoint and engine dir. Everything is a pure
function of the spec, which is what lets `--dry-run` print exactly the lines `build_roles` runs.
"""
from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from disagg.spec import DeploymentSpec, RoleSpec, SpecError
from disagg.trtllm import versions


@dataclass(frozen=True)
class Command:
    """One build step of one role; `argv` runs without a shell."""

    role: str
    step: str  # "convert_checkpoint" or "trtllm-build"
    argv: tuple[str, ...]

    def shell(self) -> str:
        """A runnable, correctly quoted shell line."""
        return shlex.join(self.argv)


def role_spec(spec: DeploymentSpec, role_name: str) -> RoleSpec:
    if spec.backend != "tensorrt_llm":
        raise SpecError("backend", f"{spec.backend!r}: TensorRT-LLM engines are built only for backend tensorrt_llm")
    if role_name not in spec.roles:
        raise SpecError(f"roles.{role_name}", f"not in the spec (roles: {', '.join(spec.roles)})")
    return spec.roles[role_name]


def checkpoint_dir(spec: DeploymentSpec, role_name: str) -> Path:
    return spec.build_dir / "trtllm" / role_name / "checkpoint"


def convert_script(release: versions.Release) -> Path:
    """The Llama converter; `TRTLLM_EXAMPLES_DIR` overrides the NGC image's examples dir."""
    examples = os.environ.get("TRTLLM_EXAMPLES_DIR", versions.DEFAULT_EXAMPLES_DIR)
    return Path(examples) / release.converter


def build_workers(role: RoleSpec, local_gpus: int | None = None) -> int:
    """`trtllm-build --workers`: ranks built in parallel, capped at the GPUs of one instance and, when
    known, at the GPUs of the build machine (rank r builds on GPU r % workers)."""
    gpus = len(role.devices[0]) if role.devices else role.world_size
    if local_gpus is not None:
        gpus = min(gpus, local_gpus)
    return max(1, min(role.world_size, gpus))


def role_commands(
    spec: DeploymentSpec,
    role_name: str,
    *,
    local_gpus: int | None = None,
) -> tuple[Command, Command]:
    """(convert, build) for one role, written for the spec's TensorRT-LLM release."""
    role = role_spec(spec, role_name)
    release = versions.release_of(spec)
    ckpt = str(checkpoint_dir(spec, role_name))
    convert = (
        "python3", str(convert_script(release)),
        "--model_dir", str(spec.model.path),
        "--output_dir", ckpt,
        "--dtype", spec.model.dtype,
        "--tp_size", str(role.tp),
        "--pp_size", str(role.pp),
    )  # fmt: skip
    build = [
        "trtllm-build",
        "--checkpoint_dir", ckpt,
        "--output_dir", str(spec.engine_dir(role_name)),
        "--max_batch_size", str(role.max_batch_size),
        "--max_input_len", str(role.max_input_len),
        "--max_seq_len", str(role.max_seq_len),
        "--max_num_tokens", str(role.max_num_tokens),
        "--tokens_per_block", str(role.tokens_per_block),
        "--kv_cache_type", "paged",
        "--gemm_plugin", "auto",
        "--gpt_attention_plugin", "auto",
        "--remove_input_padding", "enable",
        "--context_fmha", "enable",
    ]  # fmt: skip
    if role.enable_kv_cache_reuse or role.enable_chunked_context:  # both need paged context FMHA
        build += ["--use_paged_context_fmha", "enable"]
    build += ["--max_beam_width", "1", "--workers", str(build_workers(role, local_gpus))]
    return Command(role_name, "convert_checkpoint", convert), Command(role_name, "trtllm-build", tuple(build))
