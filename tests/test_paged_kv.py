"""Block-to-block KV copy between paged pools of different shardings and block sizes, against the
contiguous path (gather -> re-shard -> scatter) as the oracle."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from disagg.engine.kv_cache import KVShape, KVStorage, blocks_for
from disagg.engine.kv_wire import KVLayout
from disagg.engine.paged_kv import PagedKV

LAYERS, HEADS, HEAD_DIM, BLOCKS = 5, 4, 3, 24
SHARDINGS = [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)]


def pool(tp: int, pp: int, tpb: int, rng=None) -> tuple[KVStorage, KVLayout]:
    layout = KVLayout(LAYERS, HEADS, HEAD_DIM, tpb, tp, pp)
    stages = layout.mapping.stage_layers(LAYERS)
    shapes = [KVShape(len(stages[r // tp]), BLOCKS, tpb, HEADS // tp, HEAD_DIM) for r in range(tp * pp)]
    storage = KVStorage(shapes)
    if rng is not None:
        for arr in storage.ranks:
            arr[...] = rng.standard_normal(arr.shape)
    return storage, layout


@pytest.mark.parametrize("src_shard, dst_shard", list(itertools.product(SHARDINGS, SHARDINGS)))
@pytest.mark.parametrize("src_tpb, dst_tpb, tokens", [(4, 4, 37), (8, 3, 37), (3, 8, 16), (16, 16, 1)])
def test_copy_into_equals_gather_reshard_scatter(src_shard, dst_shard, src_tpb, dst_tpb, tokens):
    rng = np.random.default_rng(0)
    src, src_layout = pool(*src_shard, src_tpb, rng)
    src_blocks = tuple(int(b) for b in rng.permutation(BLOCKS)[: blocks_for(tokens, src_tpb)])
    paged = PagedKV(src, src_layout, src_blocks, tokens)
    dst_blocks = [int(b) for b in rng.permutation(BLOCKS)[: blocks_for(tokens, dst_tpb)]]

    direct, dst_layout = pool(*dst_shard, dst_tpb)
    paged.copy_into(direct, dst_layout, dst_blocks)
    oracle, _ = pool(*dst_shard, dst_tpb)
    paged.gather().copy_into(oracle, dst_layout, dst_blocks)

    for rank in range(dst_layout.mapping.world_size):
        np.testing.assert_array_equal(direct.ranks[rank], oracle.ranks[rank])  # every byte, untouched ones too
        assert direct.gather(rank, dst_blocks, tokens).any()
    assert paged.nbytes == paged.gather().nbytes == LAYERS * 2 * tokens * HEADS * HEAD_DIM * 4
