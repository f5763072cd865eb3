"""The KV wire format: round trip, re-sharding on import, and clear errors on bad bytes."""
from __future__ import annotations

import struct

import numpy as np
import pytest

from disagg.engine.config import Mapping
from disagg.engine.kv_wire import KVFormatError, KVLayout, SequenceKV


def sharded(tp: int, pp: int, tokens: int = 5) -> tuple[SequenceKV, np.ndarray]:
    """A payload whose full KV is a known array, split the way a tp x pp engine splits it."""
    layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=3, tokens_per_block=16, tp_size=tp, pp_size=pp)
    full = np.arange(4 * 2 * tokens * 4 * 3, dtype=np.float32).reshape(4, 2, tokens, 4, 3)
    m = layout.mapping
    shards = []
    for rank in range(m.world_size):
        tp_rank, stage = rank % tp, rank // tp
        layers = m.stage_layers(4)[stage]
        h = 4 // tp
        shards.append(full[layers.start : layers.stop, :, :, tp_rank * h : (tp_rank + 1) * h])
    return SequenceKV(layout, tokens, tuple(shards)), full


@pytest.mark.parametrize("src", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("dst", [(1, 1), (2, 2), (4, 1)])
def test_round_trip_and_reshard(src, dst):
    kv, full = sharded(*src)
    back = SequenceKV.from_bytes(kv.to_bytes())
    assert back.layout == kv.layout and back.num_tokens == 5
    np.testing.assert_array_equal(back.full(), full)
    m = Mapping(*dst)
    for rank in range(m.world_size):
        layers = m.stage_layers(4)[rank // dst[0]]
        h = 4 // dst[0]
        t = rank % dst[0]
        np.testing.assert_array_equal(back.for_rank(m, rank), full[layers.start : layers.stop, :, :, t * h : (t + 1) * h])


def test_header_is_self_describing():
    kv, _ = sharded(2, 2)
    data = kv.to_bytes()
    magic, version, header_len = struct.unpack_from("<4sHI", data)
    assert (magic, version) == (b"DKVC", 1)
    assert b'"tp_size": 2' in data[10 : 10 + header_len] and b'"tokens_per_block": 16' in data[10 : 10 + header_len]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: b"XXXX" + d[4:], "starts with b'XXXX', expected b'DKVC'"),
        (lambda d: d[:4] + struct.pack("<H", 9) + d[6:], "version 9, this build reads version 1"),
        (lambda d: d[:6], "shorter than its 10-byte prefix"),
        (lambda d: d[:-8], "shard 3: shape"),
        (lambda d: d[:10] + b"}" + d[11:], "header is malformed"),
    ],
)
def test_bad_payloads_are_rejected(mutate, message):
    kv, _ = sharded(2, 2)
    with pytest.raises(KVFormatError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SequenceKV.from_bytes(mutate(kv.to_bytes()))


def test_incompatible_model_is_rejected():
    a = KVLayout(4, 4, 3, 16, 1, 1)
    b = KVLayout(4, 8, 3, 16, 1, 1)
    with pytest.raises(KVFormatError, match="KV num_kv_heads=4 does not match this engine's num_kv_heads=8"):
        a.check_compatible(b)
