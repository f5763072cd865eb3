"""Reference-engine throughput, and decode as a fraction of the memory-bandwidth roofline.

Decode reads every weight once per step plus each sequence's KV, so its ceiling is
    tokens/s <= batch * read_bandwidth / (weight bytes + KV bytes read per step),
with read_bandwidth measured in this same run (the fastest of a numpy sum, a BLAS dot and a BLAS
matrix-vector product over a buffer far larger than the caches). Prefill is compute-bound and is reported as tokens/s only.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from disagg.checkpoint import generate_checkpoint
from disagg.engine.config import BuildConfig, EngineConfig, LlamaConfig, Mapping
from disagg.engine.engine import LLMEngine, Request
from disagg.engine.kv_cache import blocks_for
from disagg.engine.weights import load_hf_weights, write_engine


def read_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s of the fastest full read of a buffer (default 512 MiB) by numpy on this machine."""
    a = np.ones(nbytes // 4, dtype=np.float32)
    b = np.ones_like(a)
    matrix, vector = a.reshape(-1, 2048), np.ones(2048, dtype=np.float32)
    best = 0.0
    for _ in range(repeats):
        for read, bytes_read in ((a.sum, nbytes), (lambda: np.dot(a, b), 2 * nbytes), (lambda: matrix @ vector, nbytes)):
            t = time.perf_counter()
            read()
            best = max(best, bytes_read / (time.perf_counter() - t))
    return best


@dataclass
class ModelBench:
    name: str
    weight_bytes: int
    kv_bytes_per_token: int
    prefill_tps: float
    decode: dict[int, tuple[float, float]]  # batch -> (tokens/s, roofline tokens/s)


def build_engine(root: Path, preset: str, max_batch: int, prompt_len: int, decode_steps: int, reuse: bool = False) -> Path:
    ckpt = root / "checkpoints" / preset
    if not (ckpt / "config.json").is_file():
        generate_checkpoint(ckpt, preset)
    cfg = LlamaConfig.from_dir(ckpt)
    seq = prompt_len + max_batch + decode_steps + 2  # the first prompt's sequence decodes while the others prefill
    tpb = 16
    tokens = prompt_len + max_batch  # a prompt beside a full batch's decodes
    limits = BuildConfig(max_batch, prompt_len, seq, tokens, tpb, max_batch * blocks_for(seq, tpb), enable_kv_cache_reuse=reuse)
    out = root / "bench-engines" / f"{preset}-b{max_batch}-p{prompt_len}-s{seq}-t{tokens}{'-reuse' if reuse else ''}"
    if not (out / "config.json").is_file():
        write_engine(out, EngineConfig("aggregated", cfg, Mapping(1, 1), limits), load_hf_weights(ckpt))
    return out


def bench_model(root: Path, preset: str, prompt_len: int, decode_steps: int, batches: list[int], bandwidth: float) -> ModelBench:
    engine = LLMEngine(build_engine(root, preset, max(batches), prompt_len, decode_steps))
    cfg = engine.config.model
    model = engine.model
    layer_bytes = sum(a.nbytes for stage in model.shards for rank in stage for layer in rank for a in vars(layer).values() if a is not None)
    weight_bytes = layer_bytes + model.lm_head.nbytes + model.final_norm.nbytes  # embedding: one row per token, negligible
    kv_per_token = cfg.kv_bytes_per_token
    rng = np.random.default_rng(0)

    def prompt() -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(2, cfg.vocab_size, prompt_len))

    engine.generate([Request("warm", prompt(), 2)])
    t = time.perf_counter()
    reps = 3
    for i in range(reps):
        engine.generate([Request(f"p{i}", prompt(), 1)])
    prefill_tps = reps * prompt_len / (time.perf_counter() - t)

    decode = {}
    for batch in batches:
        avg_context = prompt_len + batch / 2 + decode_steps / 2  # each decodes from when its prompt was admitted
        step_bytes = weight_bytes + batch * avg_context * kv_per_token
        decode[batch] = (decode_rate(engine, prompt, batch, decode_steps), batch * bandwidth / step_bytes)
    return ModelBench(preset, weight_bytes, kv_per_token, prefill_tps, decode)


def decode_rate(engine: LLMEngine, prompt, batch: int, decode_steps: int) -> float:
    """Tokens/s of `decode_steps` steps in which all `batch` sequences decode. Their prefills come first and are
    not timed: the engine's token budget may admit one prompt per step, so the steps run until none is waiting
    or in its context phase."""
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for req_id in ids:
        engine.add_request(Request(req_id, prompt(), batch + decode_steps + 1))
    while engine.waiting or engine.num_in_context:
        engine.step()
    t = time.perf_counter()
    for _ in range(decode_steps):
        decoded = len(engine.step())
        if decoded != batch:
            raise RuntimeError(f"a timed decode step made {decoded} tokens, not {batch}: the engine's limits hold fewer sequences")
    elapsed = time.perf_counter() - t
    for req_id in ids:
        engine.abort(req_id)
    return batch * decode_steps / elapsed


def decode_tokens_per_s(root: Path, preset: str, prompt_len: int, decode_steps: int, batches: list[int]) -> dict[int, float]:
    """Decode tokens/s of the reference engine on `preset` per batch size (prompts of `prompt_len`)."""
    engine = LLMEngine(build_engine(root, preset, max(batches), prompt_len, decode_steps))
    rng = np.random.default_rng(0)
    vocab = engine.config.model.vocab_size
    return {batch: decode_rate(engine, lambda: tuple(int(t) for t in rng.integers(2, vocab, prompt_len)), batch, decode_steps)
            for batch in batches}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench engine", description=__doc__)
    p.add_argument("--root", type=Path, default=Path("build"), help="where checkpoints and engines are cached")
    p.add_argument("--decode-steps", type=int, default=32)
    args = p.parse_args(argv)
    bandwidth = read_bandwidth()
    print(f"measured read bandwidth: {bandwidth / 1e9:.2f} GB/s (fastest of sum / dot / gemv over a 512 MiB buffer)")
    rows = [
        bench_model(args.root, "tiny", 128, args.decode_steps, [1, 16], bandwidth),
        bench_model(args.root, "bench-100mb", 256, args.decode_steps, [1, 2, 8, 16, 64], bandwidth),
    ]
    print(f"\n{'model':<12} {'weights':>9} {'prefill tok/s':>14} {'batch':>6} {'decode tok/s':>13} {'roofline tok/s':>15} {'of roofline':>12}")
    for r in rows:
        for i, (batch, (tps, roof)) in enumerate(sorted(r.decode.items())):
            head = f"{r.name:<12} {r.weight_bytes / 1e6:>7.1f}MB {r.prefill_tps:>14.0f}" if i == 0 else " " * 37
            print(f"{head} {batch:>6} {tps:>13.1f} {roof:>15.1f} {tps / roof:>11.1%}")
    print("\nroofline = batch * bandwidth / (weight bytes + KV bytes read per step); prefill prompt 128 (tiny) / 256 (bench-100mb) tokens")
    return 0
