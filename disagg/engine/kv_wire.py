"""A sequence's KV cache as a versioned, self-describing wire format, re-shardable on import.

The payload keeps the sender's sharding (one array per source rank) and the header says what that
sharding is, so the receiver re-slices layers (PP) and KV heads (TP) for its own ranks:

    b"DKVC" | u16 version | u32 header length | header JSON | rank 0 bytes | rank 1 bytes | ...

header = {"layout": KVLayout, "num_tokens": n, "shards": [{"rank", "shape", "offset", "nbytes"}]}
Each rank's array is [local_layers, 2 (k|v), num_tokens, local_kv_heads, head_dim], float32, C order.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

import numpy as np

from disagg.engine.config import Mapping
from disagg.engine.kv_cache import KVStorage

MAGIC = b"DKVC"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")


class KVFormatError(ValueError):
    """The bytes are not a KV payload this version understands, or its layout does not fit the receiver."""


@dataclass(frozen=True)
class KVLayout:
    """Everything a receiver needs to interpret KV bytes it did not produce."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    tp_size: int
    pp_size: int
    dtype: str = "float32"

    @property
    def mapping(self) -> Mapping:
        return Mapping(self.tp_size, self.pp_size)

    def rank_shape(self, rank: int, num_tokens: int) -> tuple[int, ...]:
        stage = rank // self.tp_size
        layers = len(self.mapping.stage_layers(self.num_layers)[stage])
        return (layers, 2, num_tokens, self.num_kv_heads // self.tp_size, self.head_dim)

    def check_compatible(self, other: KVLayout) -> None:
        """The receiver (`other`) must have the same model geometry; sharding and block size may differ."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise KVFormatError(f"context_phase_params: KV {name}={mine} does not match this engine's {name}={theirs}")


@dataclass(frozen=True)
class SequenceKV:
    """The KV of `num_tokens` tokens of one sequence, sharded as the sending engine shards it."""

    layout: KVLayout
    num_tokens: int
    shards: tuple[np.ndarray, ...]  # indexed by source rank

    def full(self, layers: range | None = None) -> np.ndarray:
        """Un-sharded KV [layers, 2, tokens, kv_heads, head_dim] (optionally only some global layers)."""
        lay = self.layout
        stages = lay.mapping.stage_layers(lay.num_layers)
        per_stage = []
        for s, stage_layers in enumerate(stages):
            wanted = [i for i, layer in enumerate(stage_layers) if layers is None or layer in layers]
            if wanted:
                ranks = [self.shards[lay.mapping.rank(t, s)][wanted] for t in range(lay.tp_size)]
                per_stage.append(np.concatenate(ranks, axis=3))
        return np.concatenate(per_stage, axis=0)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.shards)

    def copy_into(self, dst: KVStorage, dst_layout: KVLayout, dst_blocks: list[int]) -> None:
        """Writes the sequence into `dst_blocks` of a pool sharded as `dst_layout`."""
        for rank in range(dst_layout.mapping.world_size):
            dst.scatter(rank, dst_blocks, self.for_rank(dst_layout.mapping, rank))

    def for_rank(self, mapping: Mapping, rank: int) -> np.ndarray:
        """The slice a receiving rank of `mapping` needs: its stage's layers and its TP rank's KV heads."""
        lay = self.layout
        if lay.num_kv_heads % mapping.tp_size:
            raise KVFormatError(f"KV heads {lay.num_kv_heads} do not split over receiver tp_size={mapping.tp_size}")
        tp_rank, stage = rank % mapping.tp_size, rank // mapping.tp_size
        layers = mapping.stage_layers(lay.num_layers)[stage]
        if mapping == lay.mapping:
            return self.shards[rank]
        heads = lay.num_kv_heads // mapping.tp_size
        return self.full(layers)[:, :, :, tp_rank * heads : (tp_rank + 1) * heads]

    def to_bytes(self) -> bytes:
        shards, offset = [], 0
        for rank, arr in enumerate(self.shards):
            shards.append({"rank": rank, "shape": list(arr.shape), "offset": offset, "nbytes": arr.nbytes})
            offset += arr.nbytes
        header = json.dumps({"layout": asdict(self.layout), "num_tokens": self.num_tokens, "shards": shards}).encode()
        body = b"".join(np.ascontiguousarray(a, dtype=np.float32).tobytes() for a in self.shards)
        return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + body

    @classmethod
    def from_bytes(cls, data: bytes | memoryview) -> SequenceKV:
        data = memoryview(data)
        if len(data) < _PREFIX.size:
            raise KVFormatError(f"KV payload of {len(data)} bytes is shorter than its {_PREFIX.size}-byte prefix")
        magic, version, header_len = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise KVFormatError(f"KV payload starts with {bytes(magic)!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise KVFormatError(f"KV payload version {version}, this build reads version {VERSION}")
        try:
            header = json.loads(bytes(data[_PREFIX.size : _PREFIX.size + header_len]))
            layout = KVLayout(**header["layout"])
            n = int(header["num_tokens"])
        except (ValueError, KeyError, TypeError) as exc:
            raise KVFormatError(f"KV payload header is malformed: {exc}") from exc
        body = data[_PREFIX.size + header_len :]
        shards = []
        for rank, s in enumerate(header["shards"]):
            expected = layout.rank_shape(rank, n)
            if tuple(s["shape"]) != expected or s["offset"] + s["nbytes"] > len(body):
                raise KVFormatError(f"KV payload shard {rank}: shape {s['shape']} / size do not match layout {expected}")
            arr = np.frombuffer(body[s["offset"] : s["offset"] + s["nbytes"]], dtype=np.float32)
            shards.append(arr.reshape(expected))
        if len(shards) != layout.tp_size * layout.pp_size:
            raise KVFormatError(f"KV payload has {len(shards)} shards for tp*pp={layout.tp_size * layout.pp_size}")
        return cls(layout, n, tuple(shards))
