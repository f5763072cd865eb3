"""Paged KV cache: a pool of fixed-size blocks shared by all sequences of one engine instance.

`BlockManager` does the bookkeeping (which block ids each sequence owns); `KVStorage` holds the
numbers, one array per rank, so every rank of a TP x PP engine uses the same block ids:

    rank r: [local_layers, 2 (k|v), num_blocks, tokens_per_block, local_kv_heads, head_dim]

A sequence of n tokens owns ceil(n / tokens_per_block) blocks; token t lives in block
block_table[t // tokens_per_block] at offset t % tokens_per_block.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np


class KVCacheFullError(RuntimeError):
    """Raised by `allocate` when the pool cannot hold a sequence; callers check `can_allocate` first."""


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


class BlockManager:
    """Free-list allocator over block ids, with the can_/do pairs of nano-vllm's block manager."""

    def __init__(self, num_blocks: int, tokens_per_block: int):
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.owner: dict[int, str] = {}  # block id -> sequence id, for leak reports

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def can_allocate(self, num_tokens: int) -> bool:
        return blocks_for(num_tokens, self.tokens_per_block) <= self.num_free

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        need = blocks_for(num_tokens, self.tokens_per_block)
        if need > self.num_free:
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id!r} needs {need} blocks for {num_tokens} tokens, "
                f"{self.num_free} of {self.num_blocks} free"
            )
        ids = [self.free_block_ids.popleft() for _ in range(need)]
        for b in ids:
            self.owner[b] = seq_id
        return ids

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self.owner.pop(b, None) is None:
                raise ValueError(f"block {b} freed twice")
            self.free_block_ids.append(b)


@dataclass(frozen=True)
class KVShape:
    """Shape of one rank's KV array."""

    local_layers: int
    num_blocks: int
    tokens_per_block: int
    local_kv_heads: int
    head_dim: int

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.local_layers, 2, self.num_blocks, self.tokens_per_block, self.local_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.dims)) * 4


class KVStorage:
    """One float32 KV array per rank, laid out back to back in one buffer (which may be shared memory)."""

    def __init__(self, shapes: list[KVShape], buffer=None):
        self.shapes = shapes
        self.nbytes = sum(s.nbytes for s in shapes)
        self.buffer = bytearray(self.nbytes) if buffer is None else buffer
        self.ranks: list[np.ndarray] = []
        offset = 0
        for s in shapes:
            self.ranks.append(np.ndarray(s.dims, dtype=np.float32, buffer=self.buffer, offset=offset))
            offset += s.nbytes

    @staticmethod
    def slots(block_table: list[int], start: int, stop: int, tokens_per_block: int) -> tuple[np.ndarray, np.ndarray]:
        """(block ids, offsets) of tokens start..stop-1 of a sequence."""
        t = np.arange(start, stop)
        return np.asarray(block_table)[t // tokens_per_block], t % tokens_per_block

    def gather(self, rank: int, block_table: list[int], num_tokens: int) -> np.ndarray:
        """A copy of tokens 0..num_tokens-1 of a sequence on one rank: [local_layers, 2, tokens, heads, head_dim].

        Whole blocks are copied (one contiguous run each), then the tail of the last one is cut off."""
        arr = self.ranks[rank]
        n_blocks = blocks_for(num_tokens, self.shapes[rank].tokens_per_block)
        blocks = np.take(arr, block_table[:n_blocks], axis=2)  # [L, 2, n_blocks, tpb, H, D]
        return blocks.reshape(arr.shape[0], 2, -1, *arr.shape[4:])[:, :, :num_tokens]

    def scatter(self, rank: int, block_table: list[int], kv: np.ndarray) -> None:
        """Writes kv [local_layers, 2, tokens, heads, head_dim] as tokens 0.. of a sequence, block by block."""
        arr = self.ranks[rank]
        tpb = self.shapes[rank].tokens_per_block
        for i, block in enumerate(block_table[: blocks_for(kv.shape[2], tpb)]):
            chunk = kv[:, :, i * tpb : (i + 1) * tpb]
            arr[:, :, block, : chunk.shape[2]] = chunk
