"""Paged KV cache: a pool of fixed-size blocks shared by all sequences of one engine instance.

`BlockManager` does the bookkeeping (which block ids each sequence owns); `KVStorage` holds the
numbers, one array per rank, so every rank of a TP x PP engine uses the same block ids:

    rank r: [local_layers, 2 (k|v), num_blocks, tokens_per_block, local_kv_heads, head_dim]

A sequence of n tokens owns ceil(n / tokens_per_block) blocks; token t lives in block
block_table[t // tokens_per_block] at offset t % tokens_per_block.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

import numpy as np


class KVCacheFullError(RuntimeError):
    """Raised by `allocate` when the pool cannot hold a sequence; callers check `can_allocate` first."""


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


def block_hashes(tokens: list[int] | tuple[int, ...], tokens_per_block: int, parent: int = 0) -> list[int]:
    """A hash chain over the full blocks of `tokens`: block i's hash covers every token up to its end, so
    equal hashes mean equal prefixes (TensorRT-LLM's BlockKey chain, kvCacheManager.cpp). 64-bit BLAKE2b,
    the same in every process (Python's own hash of None is not), so engines and routers can share them."""
    out = []
    for start in range(0, len(tokens) - tokens_per_block + 1, tokens_per_block):
        block = np.asarray(tokens[start : start + tokens_per_block], dtype=np.int64).tobytes()
        parent = int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "little") + block, digest_size=8).digest(), "little")
        out.append(parent)
    return out


class BlockManager:
    """Allocator over block ids, with the can_/do pairs of nano-vllm's block manager.

    With `reuse` (TensorRT-LLM's `enable_kv_cache_reuse`), blocks are reference-counted: a full block
    whose hash was `register`ed stays cached after its last owner frees it, on an LRU list of evictable
    blocks, until a request reuses it (`match`, then `allocate(..., reuse=...)`) or an allocation needs
    the room (the least recently freed goes first, as TensorRT-LLM's LRU eviction policy). Evictable
    blocks count as free: `num_used` is the blocks some sequence holds."""

    def __init__(self, num_blocks: int, tokens_per_block: int, reuse: bool = False):
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        self.reuse = reuse
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.refs: dict[int, int] = {}  # block id -> sequences holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced, least recently freed first
        self.hash_of: dict[int, int] = {}  # block id -> hash of its (full) content
        self.by_hash: dict[int, int] = {}  # hash -> the block id holding that content
        self.version = 0  # changes whenever the set of cached contents does

    @property
    def num_free(self) -> int:
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose content is registered, held or evictable."""
        return len(self.by_hash)

    def match(self, hashes: list[int]) -> list[int]:
        """The blocks holding the longest prefix of `hashes` (empty without reuse)."""
        found = []
        for h in hashes if self.reuse else ():
            block = self.by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def can_allocate(self, num_tokens: int, reuse: list[int] = ()) -> bool:
        need = blocks_for(num_tokens, self.tokens_per_block) - len(reuse)
        return need <= self.num_free - sum(1 for b in reuse if b in self.evictable)

    def allocate(self, seq_id: str, num_tokens: int, reuse: list[int] = ()) -> list[int]:
        """Blocks for `num_tokens`: the `reuse`d ones (from `match`) first, then fresh ones."""
        if not self.can_allocate(num_tokens, reuse):
            need = blocks_for(num_tokens, self.tokens_per_block) - len(reuse)
            raise KVCacheFullError(
                f"KV cache full: sequence {seq_id!r} needs {need} blocks for {num_tokens} tokens, "
                f"{self.num_free} of {self.num_blocks} free"
            )
        ids = list(reuse)
        for b in ids:
            self.evictable.pop(b, None)
            self.refs[b] = self.refs.get(b, 0) + 1
        for _ in range(blocks_for(num_tokens, self.tokens_per_block) - len(ids)):
            b = self.free_block_ids.popleft() if self.free_block_ids else self._evict()
            self.refs[b] = 1
            ids.append(b)
        return ids

    def _evict(self) -> int:
        b, _ = self.evictable.popitem(last=False)
        del self.by_hash[self.hash_of.pop(b)]
        self.version += 1
        return b

    def register(self, block_id: int, block_hash: int) -> None:
        """Block `block_id` is full and holds the content `block_hash` names: later requests may reuse it.
        Content already cached in another block keeps that one."""
        if self.reuse and block_hash not in self.by_hash and block_id not in self.hash_of:
            self.by_hash[block_hash] = block_id
            self.hash_of[block_id] = block_hash
            self.version += 1

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            refs = self.refs.pop(b, 0)
            if refs == 0:
                raise ValueError(f"block {b} freed twice")
            if refs > 1:
                self.refs[b] = refs - 1
            elif b in self.hash_of:
                self.evictable[b] = None
            else:
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
