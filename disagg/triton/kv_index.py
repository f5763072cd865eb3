"""Which prompt blocks each engine instance holds in its prefix cache, for cache-aware routing.

An engine instance with `enable_kv_cache_reuse` publishes the hashes of its cached blocks
(disagg.engine.kv_cache.block_hashes: the same 64-bit chain in every process) whenever they change, as one
small file per instance beside the load board, rewritten atomically. This is a snapshot where TensorRT-LLM
streams KV cache events (stored / removed blocks) for Dynamo's KV router; the router's question is the
same: how long a prefix of this prompt does each instance already hold.
"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from disagg.atomic_file import replace_file
from disagg.triton.load_board import board_dir


def _path(key: str, model: str, instance: str) -> Path:
    return board_dir() / f"disagg-kvindex-{key}-{model}-{instance}.npy"


def publish(key: str, model: str, instance: str, tokens_per_block: int, hashes: np.ndarray) -> None:
    """Replaces the instance's index: [tokens_per_block, hash, hash, ...] as uint64."""
    index = io.BytesIO()
    np.save(index, np.concatenate([np.asarray([tokens_per_block], dtype=np.uint64), hashes.astype(np.uint64)]))
    replace_file(_path(key, model, instance), index.getvalue())


def withdraw(key: str, model: str, instance: str) -> None:
    _path(key, model, instance).unlink(missing_ok=True)


class IndexReader:
    """Reads the indexes of models, re-reading a file only when it changed."""

    def __init__(self, key: str):
        self.key = key
        self._cache: dict[Path, tuple[int, int, set[int]]] = {}  # path -> (mtime_ns, tokens_per_block, hashes)

    def held(self, model: str) -> tuple[int, set[int]]:
        """(tokens_per_block, the union of the model's instances' cached block hashes); (0, empty) if none."""
        tpb, held = 0, set()
        for path in board_dir().glob(f"disagg-kvindex-{self.key}-{model}-*.npy"):
            try:
                mtime = path.stat().st_mtime_ns
                cached = self._cache.get(path)
                if cached is None or cached[0] != mtime:
                    raw = np.load(path)
                    cached = (mtime, int(raw[0]), set(raw[1:].tolist()))
                    self._cache[path] = cached
            except (OSError, ValueError, IndexError):
                continue  # being replaced, or withdrawn
            tpb = cached[1]
            held |= cached[2]
        return tpb, held
