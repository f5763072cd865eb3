"""The Llama decoder as Hugging Face defines it, in numpy, executing a TP x PP engine in-process.

Each rank holds its shard (see weights.py). A step runs the pipeline stages in order; within a stage
every TP rank computes its heads / MLP columns and the partial outputs are summed, which is the
all-reduce of a real tensor-parallel engine. Sequences in a step may have any number of new tokens
(a whole prompt, or one token while decoding), so prefill and in-flight decode share one code path.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagg.engine.config import EngineConfig, LlamaConfig
from disagg.engine.kv_cache import KVStorage, blocks_for


@dataclass
class StepInput:
    """One sequence's part of a step: new token ids at positions start.., and where its KV lives."""

    token_ids: np.ndarray  # [n] int
    start: int  # position of token_ids[0]
    block_table: list[int]


VECTOR_ROWS = 8  # up to this many rows are multiplied one at a time


@dataclass(frozen=True)
class Projection:
    """A linear layer's weight in both layouts. OpenBLAS (numpy 1.26's, one thread) multiplies one row fastest by
    [in, out], a matrix-vector product, and so a few rows, one by one while the weight stays in cache; more rows
    by [out, in]. Through [in, out] alone, the bench model's matmuls took 2-4x as long at 2-8 rows and 1.3-1.6x
    at 16-32. Twice the weights' memory, for the step's speed."""

    out_in: np.ndarray
    in_out: np.ndarray

    @classmethod
    def of(cls, weight: np.ndarray) -> Projection:
        """`weight` [out, in], as Hugging Face stores a linear layer's."""
        return cls(np.ascontiguousarray(weight), np.ascontiguousarray(weight.T))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x [rows, in] -> [rows, out]."""
        if len(x) <= VECTOR_ROWS:
            return x @ self.in_out if len(x) == 1 else np.stack([row @ self.in_out for row in x])
        return x @ self.out_in.T

    @property
    def nbytes(self) -> int:
        """What a step reads: one layout."""
        return self.out_in.nbytes


@dataclass(frozen=True)
class LayerShard:
    attn_norm: np.ndarray  # [D]
    qkv: Projection  # D -> (Hq_l + 2 Hkv_l) * hd
    qkv_bias: np.ndarray | None
    o: Projection  # Hq_l * hd -> D
    o_bias: np.ndarray | None
    mlp_norm: np.ndarray  # [D]
    gate_up: Projection  # D -> 2 F_l
    gate_up_bias: np.ndarray | None
    down: Projection  # F_l -> D
    down_bias: np.ndarray | None


def _cat(*arrays):
    return None if arrays[0] is None else np.concatenate(arrays)


def layer_shard(w: dict[str, np.ndarray], layer: int) -> LayerShard:
    """A rank's HF-named tensors, q|k|v and gate|up fused."""
    p = f"model.layers.{layer}."
    a, m = p + "self_attn.", p + "mlp."
    return LayerShard(
        attn_norm=w[p + "input_layernorm.weight"],
        qkv=Projection.of(np.concatenate([w[a + "q_proj.weight"], w[a + "k_proj.weight"], w[a + "v_proj.weight"]])),
        qkv_bias=_cat(w.get(a + "q_proj.bias"), w.get(a + "k_proj.bias"), w.get(a + "v_proj.bias")),
        o=Projection.of(w[a + "o_proj.weight"]),
        o_bias=w.get(a + "o_proj.bias"),
        mlp_norm=w[p + "post_attention_layernorm.weight"],
        gate_up=Projection.of(np.concatenate([w[m + "gate_proj.weight"], w[m + "up_proj.weight"]])),
        gate_up_bias=_cat(w.get(m + "gate_proj.bias"), w.get(m + "up_proj.bias")),
        down=Projection.of(w[m + "down_proj.weight"]),
        down_bias=w.get(m + "down_proj.bias"),
    )


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x * (1.0 / np.sqrt(variance + eps)))


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Rotary frequencies, including the `linear` and `llama3` rope_scaling of Llama 3.x checkpoints."""
    d = cfg.head_dim
    inv_freq = (1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))).astype(np.float32)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32)
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * np.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [T, H, hd]; HF's rotate_half convention (first half / second half, not interleaved)."""
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


ATTEND_ROWS = 256  # queries attended at once: a whole prompt's scores ([heads, n, n] floats) are memory-bound here


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int) -> np.ndarray:
    """Causal grouped-query attention of q [n, Hq, hd] (positions start..) over k, v [L, Hkv, hd].

    More than ATTEND_ROWS queries go in blocks, each over the keys it may see (as a chunked prompt's
    chunks are), so no [n, n] score matrix is made: for a 1500-token prompt of the bench model that took
    1.9x the time, most of it passes over memory (TensorRT-LLM's context attention makes none either)."""
    n, hq, hd = q.shape
    if n > ATTEND_ROWS:
        return np.concatenate([attend(q[i : i + ATTEND_ROWS], k[: start + i + ATTEND_ROWS], v[: start + i + ATTEND_ROWS], start + i)
                               for i in range(0, n, ATTEND_ROWS)])
    length, hkv, _ = k.shape
    g = hq // hkv
    qg = q.reshape(n, hkv, g, hd).transpose(1, 2, 0, 3)  # [Hkv, g, n, hd]
    scores = qg @ k.transpose(1, 2, 0)[:, None]  # [Hkv, g, n, L]
    scores *= np.float32(hd**-0.5)
    if n > 1:
        scores[:, :, np.arange(length)[None, :] > (start + np.arange(n))[:, None]] = np.float32(-np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = scores @ v.transpose(1, 0, 2)[:, None]  # [Hkv, g, n, hd]
    return out.transpose(2, 0, 1, 3).reshape(n, hq * hd)


class LlamaModel:
    """All ranks of one engine: `forward` returns the last-token logits of each sequence in the step."""

    def __init__(self, config: EngineConfig, rank_weights: list[dict[str, np.ndarray]], kv: KVStorage):
        self.cfg = config.model
        self.mapping = config.mapping
        self.tokens_per_block = config.build.tokens_per_block
        self.kv = kv
        m = self.mapping
        self.stages = m.stage_layers(self.cfg.num_hidden_layers)
        # shards[pp][tp][local_layer]
        self.shards = [
            [[layer_shard(rank_weights[m.rank(t, s)], layer) for layer in self.stages[s]] for t in range(m.tp_size)]
            for s in range(m.pp_size)
        ]
        self.embed = rank_weights[m.rank(0, 0)]["model.embed_tokens.weight"]
        last = rank_weights[m.rank(0, m.pp_size - 1)]
        self.final_norm = last["model.norm.weight"]
        self.lm_head = Projection.of(last["lm_head.weight"])
        self.inv_freq = rope_inv_freq(self.cfg)
        self.local_q = self.cfg.num_attention_heads // m.tp_size
        self.local_kv = self.cfg.num_key_value_heads // m.tp_size

    def forward(self, batch: list[StepInput]) -> np.ndarray:
        cfg, hd = self.cfg, self.cfg.head_dim
        positions = np.concatenate([np.arange(s.start, s.start + len(s.token_ids)) for s in batch])
        freqs = positions[:, None].astype(np.float32) * self.inv_freq[None, :]
        emb = np.concatenate([freqs, freqs], axis=-1)
        cos, sin = np.cos(emb), np.sin(emb)
        bounds = np.cumsum([0] + [len(s.token_ids) for s in batch])
        new_slots = [KVStorage.slots(s.block_table, s.start, s.start + len(s.token_ids), self.tokens_per_block) for s in batch]
        lengths = [s.start + len(s.token_ids) for s in batch]
        tables = [s.block_table[: blocks_for(n, self.tokens_per_block)] for s, n in zip(batch, lengths)]

        x = self.embed[np.concatenate([s.token_ids for s in batch])]
        for stage in range(self.mapping.pp_size):
            for local in range(len(self.stages[stage])):
                h = rms_norm(x, self.shards[stage][0][local].attn_norm, cfg.rms_norm_eps)
                partial = []
                for tp in range(self.mapping.tp_size):
                    w = self.shards[stage][tp][local]
                    cache = self.kv.ranks[self.mapping.rank(tp, stage)][local]  # [2, blocks, tpb, Hkv_l, hd]
                    qkv = w.qkv(h)
                    if w.qkv_bias is not None:
                        qkv = qkv + w.qkv_bias
                    nq, nk = self.local_q * hd, self.local_kv * hd
                    q = apply_rope(qkv[:, :nq].reshape(-1, self.local_q, hd), cos, sin)
                    k = apply_rope(qkv[:, nq : nq + nk].reshape(-1, self.local_kv, hd), cos, sin)
                    v = qkv[:, nq + nk :].reshape(-1, self.local_kv, hd)
                    outs = []
                    for i, s in enumerate(batch):
                        lo, hi = bounds[i], bounds[i + 1]
                        blocks, offs = new_slots[i]
                        cache[0, blocks, offs] = k[lo:hi]
                        cache[1, blocks, offs] = v[lo:hi]
                        kv = np.take(cache, tables[i], axis=1).reshape(2, -1, *cache.shape[3:])  # whole blocks: runs, not tokens
                        outs.append(attend(q[lo:hi], kv[0, : lengths[i]], kv[1, : lengths[i]], s.start))
                    partial.append(w.o(np.concatenate(outs)))
                x = x + self._all_reduce(partial, self.shards[stage][0][local].o_bias)
                h = rms_norm(x, self.shards[stage][0][local].mlp_norm, cfg.rms_norm_eps)
                partial = []
                for tp in range(self.mapping.tp_size):
                    w = self.shards[stage][tp][local]
                    gu = w.gate_up(h)
                    if w.gate_up_bias is not None:
                        gu = gu + w.gate_up_bias
                    f = gu.shape[1] // 2
                    partial.append(w.down(silu(gu[:, :f]) * gu[:, f:]))
                x = x + self._all_reduce(partial, self.shards[stage][0][local].down_bias)
        last = x[bounds[1:] - 1]
        return self.lm_head(rms_norm(last, self.final_norm, cfg.rms_norm_eps))

    @staticmethod
    def _all_reduce(partial: list[np.ndarray], bias: np.ndarray | None) -> np.ndarray:
        out = partial[0] if len(partial) == 1 else np.sum(partial, axis=0)
        return out if bias is None else out + bias
