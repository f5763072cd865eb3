"""The TensorRT-LLM releases this path targets: one table of what each one's Triton backend reads and can do.

The path needs three things that only a window of releases has together:
- the TensorRT engine backend, `convert_checkpoint.py` + `trtllm-build` (deprecation warnings since
  TensorRT-LLM PR #11723, Feb 2026; deleted from main in mid-2026, PRs #15763..#16369);
- the Triton `tensorrtllm` C++ backend with the `context_phase_params` input/output and orchestrator mode
  with pre-spawned ranks (`participant_ids`), present in tensorrtllm_backend since 0.16;
- an NGC `tritonserver:<yy.mm>-trtllm-python-py3` image shipping both (Triton's compatibility matrix).

We target the 0.17 to 1.0 lines: 0.17 is the first release on the CUDA 12.8 images (25.01); from 1.0 on
the PyTorch workflow is the recommended one and later releases head for the deprecation above, so 1.1+
is refused rather than half-trusted. Rendering, the orchestrator's request names, the launch script and
spec validation all read `Release`; docs/tensorrt-llm.md says where each entry comes from.
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

from disagg.spec import DeploymentSpec, SpecError

# Inside the NGC images the TensorRT-LLM examples live in /app/examples (tensorrtllm_backend's
# dockerfile: `WORKDIR /app`, `COPY tensorrt_llm/examples examples`).
DEFAULT_EXAMPLES_DIR = "/app/examples"

# Engine-model inputs whose names changed across releases, under their newest names. tensorrtllm_backend
# PR #749 (commit c2e65b8, May 2025, on the r25.05 branch) renamed random_seed and min_length;
# inflight_batcher_llm/src/utils.cc reads return_kv_cache_reuse_stats through 0.18 and return_perf_metrics
# from 0.19 (utils.h, at each tag).
RENAMED_INPUTS = ("seed", "min_tokens", "return_perf_metrics")


@dataclass(frozen=True)
class Release:
    """One TensorRT-LLM release line as the NGC images ship it."""

    line: tuple[int, int]  # (major, minor)
    images: tuple[str, ...]  # NGC Triton release tags (yy.mm) that ship it
    inputs: tuple[str, str, str]  # the names it reads for RENAMED_INPUTS, in that order
    kv_transports: tuple[str, ...]  # cache transceivers its Triton backend can use
    transport_from_env: bool  # False: the backend pins MPI itself and ignores TRTLLM_USE_*_KVCACHE
    converter: str  # the Llama converter, relative to the examples dir
    chunked_context: bool = True  # `enable_chunked_context` (in the backend since 0.8)

    @property
    def name(self) -> str:
        return f"{self.line[0]}.{self.line[1]}"

    @property
    def image(self) -> str:
        """The newest NGC image of the line."""
        return f"nvcr.io/nvidia/tritonserver:{self.images[-1]}-trtllm-python-py3"

    def input_names(self) -> dict[str, str]:
        """newest name -> this release's, for the inputs it names differently."""
        return {new: old for new, old in zip(RENAMED_INPUTS, self.inputs) if new != old}

    def input_name(self, name: str) -> str:
        return self.input_names().get(name, name)

    def transport_env(self, transport: str) -> list[tuple[str, str]]:
        """What selects `transport` on this release: an environment variable, or nothing (MPI is pinned)."""
        return [(f"TRTLLM_USE_{transport.upper()}_KVCACHE", "1")] if self.transport_from_env else []


_OLD_NAMES = ("random_seed", "min_length", "return_kv_cache_reuse_stats")
RELEASES = (
    # No UCX cache transfer before 0.19 (TensorRT-LLM PRs #3065/#3101, late March 2025); the 0.17/0.18
    # docs tell to set TRTLLM_USE_MPI_KVCACHE=1.
    Release((0, 17), ("25.01", "25.02"), _OLD_NAMES, ("mpi",), True, "llama/convert_checkpoint.py"),
    Release((0, 18), ("25.03", "25.04"), _OLD_NAMES, ("mpi",), True, "llama/convert_checkpoint.py"),
    # 25.05's backend is built from r25.05, which has PR #749's names; the v0.19.0 tag itself does not.
    Release((0, 19), ("25.05",), RENAMED_INPUTS, ("ucx", "mpi"), True, "models/core/llama/convert_checkpoint.py"),
    Release((0, 20), ("25.06", "25.07"), RENAMED_INPUTS, ("ucx", "mpi"), True, "models/core/llama/convert_checkpoint.py"),
    # TensorRT-LLM PR #5234 (merged June 2025): the Triton backend sets CacheTransceiverConfig(MPI) itself
    # (model_instance_state.cc), so only MPI works, within one MPI world.
    Release((0, 21), ("25.08",), RENAMED_INPUTS, ("mpi",), False, "models/core/llama/convert_checkpoint.py"),
    Release((1, 0), ("25.09", "25.10", "25.11"), RENAMED_INPUTS, ("mpi",), False, "models/core/llama/convert_checkpoint.py"),
)
SUPPORTED_RANGE = f"{RELEASES[0].name} .. {RELEASES[-1].name}"
# What `--dry-run` and rendering assume when neither the spec nor an installed package names a release.
TARGET = RELEASES[-1]


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a PEP 440-ish version string such as `1.0.0rc4` or `0.17.0.post1`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"unrecognised TensorRT-LLM version {version!r}")
    return int(match[1]), int(match[2])


def find(version: str) -> Release | None:
    """The release line of `version`, None when it is outside the supported range or unreadable."""
    try:
        line = parse(version)
    except ValueError:
        return None
    return next((r for r in RELEASES if r.line == line), None)


def release_of(spec: DeploymentSpec) -> Release:
    """The release a spec targets: its `trtllm_release`, else TARGET."""
    if spec.trtllm_release is None:
        return TARGET
    release = find(spec.trtllm_release)
    if release is None:
        raise SpecError(
            "trtllm_release",
            f"{spec.trtllm_release!r} is not a supported TensorRT-LLM release line (supported: "
            f"{', '.join(r.name for r in RELEASES)})",
        )
    return release


def images() -> str:
    """The supported images in one line."""
    tags = ", ".join(tag for r in RELEASES for tag in r.images)
    return f"nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3, <tag> one of {tags}"


def detect_version() -> str:
    """The installed `tensorrt_llm` version, read from its metadata (importing it would need a GPU)."""
    try:
        found = importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "TensorRT-LLM is not installed: trtllm-build and convert_checkpoint.py come with it. "
            f"Run build-engines inside an NGC container ({images()}) or use --dry-run to print the commands."
        ) from None
    if find(found) is None:
        raise RuntimeError(
            f"TensorRT-LLM {found} is outside the supported range {SUPPORTED_RANGE}: this path needs the "
            "TensorRT engine backend (trtllm-build) and the Triton tensorrtllm backend's context_phase_params. "
            f"Use one of: {images()}."
        )
    return found
