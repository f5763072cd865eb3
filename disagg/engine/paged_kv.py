"""A sequence's KV where it lies in another engine's paged pool, copied block to block into this one.

On one node decode maps prefill's KV pool (shared memory) and copies the handed-off sequence straight
from prefill's blocks into the blocks it reserved, with no buffer in between. The two engines may shard
differently (TP x PP) and use different block sizes: each destination rank takes, from every source
rank it overlaps, the shared layers and KV heads, in runs of tokens that stay inside one block on both
sides. `gather` is the other way out: a contiguous `SequenceKV` (for a decode that has no room yet, so
prefill's blocks can be freed while it waits).
"""
from __future__ import annotations

from dataclasses import dataclass

from disagg.engine.kv_cache import KVStorage
from disagg.engine.kv_wire import KVLayout, SequenceKV


def _rank_span(layout: KVLayout, rank: int) -> tuple[range, range]:
    """(global layers, global KV heads) that `rank` of `layout` holds."""
    tp_rank, stage = rank % layout.tp_size, rank // layout.tp_size
    heads = layout.num_kv_heads // layout.tp_size
    return layout.mapping.stage_layers(layout.num_layers)[stage], range(tp_rank * heads, (tp_rank + 1) * heads)


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _token_runs(num_tokens: int, *block_sizes: int) -> list[tuple[int, int]]:
    """[start, stop) runs of tokens that do not cross a block boundary of any of `block_sizes`."""
    cuts = sorted({0, num_tokens, *(t for size in block_sizes for t in range(size, num_tokens, size))})
    return list(zip(cuts, cuts[1:]))


@dataclass(frozen=True)
class PagedKV:
    """Tokens 0..num_tokens-1 of one sequence in `storage` (sharded as `layout`), at `block_ids`."""

    storage: KVStorage
    layout: KVLayout
    block_ids: tuple[int, ...]
    num_tokens: int

    @property
    def nbytes(self) -> int:
        return sum(
            len(layers) * 2 * self.num_tokens * len(heads) * self.layout.head_dim * 4
            for layers, heads in (_rank_span(self.layout, r) for r in range(self.layout.mapping.world_size))
        )

    def gather(self) -> SequenceKV:
        shards = tuple(self.storage.gather(r, list(self.block_ids), self.num_tokens) for r in range(self.layout.mapping.world_size))
        return SequenceKV(self.layout, self.num_tokens, shards)

    def copy_into(self, dst: KVStorage, dst_layout: KVLayout, dst_blocks: list[int]) -> None:
        src_tpb, dst_tpb = self.layout.tokens_per_block, dst_layout.tokens_per_block
        runs = _token_runs(self.num_tokens, src_tpb, dst_tpb)
        for d_rank in range(dst_layout.mapping.world_size):
            d_layers, d_heads = _rank_span(dst_layout, d_rank)
            for s_rank in range(self.layout.mapping.world_size):
                s_layers, s_heads = _rank_span(self.layout, s_rank)
                layers, heads = _overlap(d_layers, s_layers), _overlap(d_heads, s_heads)
                if not layers or not heads:
                    continue
                d = dst.ranks[d_rank][layers.start - d_layers.start : layers.stop - d_layers.start]
                s = self.storage.ranks[s_rank][layers.start - s_layers.start : layers.stop - s_layers.start]
                dh = slice(heads.start - d_heads.start, heads.stop - d_heads.start)
                sh = slice(heads.start - s_heads.start, heads.stop - s_heads.start)
                for start, stop in runs:
                    sb, so = self.block_ids[start // src_tpb], start % src_tpb
                    db, do = dst_blocks[start // dst_tpb], start % dst_tpb
                    d[:, :, db, do : do + stop - start, dh] = s[:, :, sb, so : so + stop - start, sh]
