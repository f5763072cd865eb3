"""TensorRT-LLM releases this path targets, and the NGC Triton images that ship them.

The path needs three things that only a window of releases has together:
- the TensorRT engine backend, `convert_checkpoint.py` + `trtllm-build` (deprecation warnings since
  TensorRT-LLM PR #11723, Feb 2026; deleted from main in mid-2026, PRs #15763..#16369);
- the Triton `tensorrtllm` C++ backend with the `context_phase_params` input/output and orchestrator mode
  with pre-spawned ranks (`participant_ids`), present in tensorrtllm_backend since 0.16;
- an NGC `tritonserver:<yy.mm>-trtllm-python-py3` image shipping both (Triton's compatibility matrix).

We target 0.17.0 up to and including 1.0.x: 0.17 is the first release on the CUDA 12.8 images (25.01);
from 1.0 on the PyTorch workflow is the recommended one and later releases head for the deprecation
above, so 1.1+ images are refused rather than half-trusted.
"""
from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass

MIN_VERSION = (0, 17)  # inclusive
MAX_VERSION = (1, 1)  # exclusive: 1.0.x is the last supported line
SUPPORTED_RANGE = "0.17.0 .. 1.0.x"

# Inside the NGC images the TensorRT-LLM examples live in /app/examples (tensorrtllm_backend's
# dockerfile: `WORKDIR /app`, `COPY tensorrt_llm/examples examples`).
DEFAULT_EXAMPLES_DIR = "/app/examples"


@dataclass(frozen=True)
class Container:
    """One NGC Triton image and the TensorRT-LLM release inside it."""

    tag: str  # Triton release, yy.mm
    trtllm: str

    @property
    def image(self) -> str:
        return f"nvcr.io/nvidia/tritonserver:{self.tag}-trtllm-python-py3"


# From Triton's release compatibility matrix (server docs/introduction/compatibility.md).
CONTAINERS = (
    Container("25.01", "0.17.0"),
    Container("25.02", "0.17.0.post1"),
    Container("25.03", "0.18.0"),
    Container("25.04", "0.18.2"),
    Container("25.05", "0.19.0"),
    Container("25.06", "0.20.0"),
    Container("25.07", "0.20.0"),
    Container("25.08", "0.21.0"),
    Container("25.09", "1.0.0"),
    Container("25.10", "1.0.0"),
    Container("25.11", "1.0.3.2510"),
)

# The release `--dry-run` writes commands for: the newest 1.0.0 image on the CUDA 12.9 stack.
TARGET = CONTAINERS[9]


def parse(version: str) -> tuple[int, int]:
    """(major, minor) of a PEP 440-ish version string such as `1.0.0rc4` or `0.17.0.post1`."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"unrecognised TensorRT-LLM version {version!r}")
    return int(match[1]), int(match[2])


def is_supported(version: str) -> bool:
    try:
        return MIN_VERSION <= parse(version) < MAX_VERSION
    except ValueError:
        return False


def llama_convert_script(version: str = TARGET.trtllm) -> str:
    """The Llama example's converter, relative to the examples dir.

    Upstream moved `examples/llama` to `examples/models/core/llama` on main in April 2025, after 0.18.2
    (tensorrtllm_backend's docs followed in commit dbae4e8); we take 0.19.0 (May 2025) as the first
    release with the new layout (inference: its branch was cut after the move).
    """
    if parse(version) < (0, 19):
        return "llama/convert_checkpoint.py"
    return "models/core/llama/convert_checkpoint.py"


def images() -> str:
    """The supported images in one line."""
    return f"nvcr.io/nvidia/tritonserver:<tag>-trtllm-python-py3, <tag> one of {', '.join(c.tag for c in CONTAINERS)}"


def detect_version() -> str:
    """The installed `tensorrt_llm` version, read from its metadata (importing it would need a GPU)."""
    try:
        found = importlib.metadata.version("tensorrt_llm")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "TensorRT-LLM is not installed: trtllm-build and convert_checkpoint.py come with it. "
            f"Run build-engines inside an NGC container ({images()}) or use --dry-run to print the commands."
        ) from None
    if not is_supported(found):
        raise RuntimeError(
            f"TensorRT-LLM {found} is outside the supported range {SUPPORTED_RANGE}: this path needs the "
            "TensorRT engine backend (trtllm-build) and the Triton tensorrtllm backend's context_phase_params. "
            f"Use one of: {images()}."
        )
    return found
