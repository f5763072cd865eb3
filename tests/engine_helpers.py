"""Builds tiny engines straight from a generated checkpoint, for tests below the Triton boundary."""
from __future__ import annotations

from pathlib import Path

from disagg.checkpoint import generate_checkpoint
from disagg.engine.config import BuildConfig, EngineConfig, LlamaConfig, Mapping
from disagg.engine.engine import LLMEngine
from disagg.engine.weights import load_hf_weights, write_engine

LIMITS = BuildConfig(max_batch_size=16, max_input_len=256, max_seq_len=320, max_num_tokens=1024, tokens_per_block=16, kv_cache_blocks=400)


class EngineFactory:
    """One checkpoint, engines of any TP x PP built on first use and cached on disk."""

    def __init__(self, root: Path, checkpoint: Path | None = None):
        self.root = root
        self.checkpoint = checkpoint or generate_checkpoint(root / "tiny-llama", "tiny", seed=0)
        self.config = LlamaConfig.from_dir(self.checkpoint)
        self.weights = load_hf_weights(self.checkpoint)

    def engine_dir(self, tp: int = 1, pp: int = 1, limits: BuildConfig = LIMITS, role: str = "aggregated") -> Path:
        flags = "".join(f"-{name}" for name, on in (("chunked", limits.enable_chunked_context), ("reuse", limits.enable_kv_cache_reuse)) if on)
        path = self.root / f"{role}-tp{tp}-pp{pp}-{limits.kv_cache_blocks}b{limits.max_batch_size}-{limits.max_num_tokens}t{flags}"
        if not (path / "config.json").is_file():
            write_engine(path, EngineConfig(role, self.config, Mapping(tp, pp), limits), self.weights)
        return path

    def engine(self, tp: int = 1, pp: int = 1, limits: BuildConfig = LIMITS, role: str = "aggregated") -> LLMEngine:
        return LLMEngine(self.engine_dir(tp, pp, limits, role))
