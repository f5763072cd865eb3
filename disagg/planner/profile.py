"""Step times of a role's engine, measured on the engine itself and fitted to a two-regime linear model.

A step that computes only generating sequences' tokens reads every weight once whatever the batch, so it
costs `decode`: base + per_token * N + per_attended * A, with N the sequences and A the attention work (the
sum of their contexts). A step with prompt tokens (a prefill, or a chunk beside the decodes) is bound by
the matmuls over its N new tokens: `prompt`, the same three terms fitted on such steps, where a prompt or
chunk of n tokens after o cached ones attends to n * (o + (n + 1) / 2). Timed in this process with the
engine's own code (one BLAS thread, as `loadtest compare` serves); the fit's worst relative error over the
timed steps is kept beside it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from disagg.engine.engine import LLMEngine, Request

Sample = tuple[int, float, float]  # (new tokens, attended, seconds) of one timed step


@dataclass(frozen=True)
class Linear:
    base_s: float
    per_token_s: float
    per_attended_s: float

    def __call__(self, new_tokens: int, attended: float) -> float:
        return self.base_s + self.per_token_s * new_tokens + self.per_attended_s * attended


@dataclass(frozen=True)
class StepModel:
    decode: Linear
    prompt: Linear
    fit_error: float  # the largest |predicted - measured| / measured over the timed steps

    def step_s(self, new_tokens: int, attended: float, prompt_tokens: bool) -> float:
        return (self.prompt if prompt_tokens else self.decode)(new_tokens, attended)

    def prefill_s(self, n: int) -> float:
        return self.prompt(n, n * (n + 1) / 2)

    def decode_s(self, batch: int, context: float) -> float:
        return self.decode(batch, batch * context)

    @classmethod
    def from_dict(cls, raw: dict) -> StepModel:
        return cls(Linear(**raw["decode"]), Linear(**raw["prompt"]), raw["fit_error"])


def fit_linear(samples: list[Sample]) -> tuple[Linear, float]:
    """The least-squares Linear (relative errors: a 5 ms step counts as much as a 2 s one), its worst error."""
    x = np.array([[1.0, n, a] for n, a, _ in samples])
    y = np.array([s for _, _, s in samples])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    coef = np.maximum(coef, 0.0)
    return Linear(*map(float, coef)), float(np.max(np.abs(x @ coef - y) / y))


def fit(decode: list[Sample], prompt: list[Sample]) -> StepModel:
    d, d_err = fit_linear(decode)
    p, p_err = fit_linear(prompt)
    return StepModel(d, p, max(d_err, p_err))


def _steps(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def profile_engine(engine_dir: Path, progress: bool = True) -> StepModel:
    """Times prompts (whole, or chunk by chunk where the engine chunks them) at lengths up to the engine's
    max input length, and decode steps at batch sizes up to its max batch and two context lengths. One
    BLAS thread, as the engine model serves (disagg.triton.engine_model)."""
    with threadpool_limits(1, user_api="blas"):
        return _profile(LLMEngine(engine_dir), engine_dir.name, progress)


def _profile(engine: LLMEngine, name: str, progress: bool) -> StepModel:
    b = engine.config.build
    vocab = engine.config.model.vocab_size
    rng = np.random.default_rng(0)
    longest = min(b.max_input_len, b.max_seq_len - 8)
    lengths = sorted({max(8, int(longest * f)) for f in (0.05, 0.25, 0.5, 1.0)})
    lengths = [n for n in lengths if n <= b.max_num_tokens or b.enable_chunked_context]
    batches = sorted({n for n in (1, 4, 16, b.max_batch_size) if n <= b.max_batch_size})
    contexts = sorted({max(16, int((b.max_seq_len - 8) * f)) for f in (0.1, 0.8)})

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(2, vocab, n))

    engine.generate([Request("warm", prompt(lengths[0]), 2)])
    decode: list[Sample] = []
    prompted: list[Sample] = []

    def new_tokens(batch: int, context: int) -> int:
        """Enough to be still generating once the batch's last prompt is in (twice the steps its prompts
        take at the smallest chunk, the budget left beside the batch's decodes): a sequence that ended
        early would leave a smaller batch."""
        chunk = max(b.tokens_per_block, (b.max_num_tokens - batch) // b.tokens_per_block * b.tokens_per_block)
        chunks = -(-context // chunk) if b.enable_chunked_context else 1
        return max(6, min(b.max_seq_len - context, 2 * batch * chunks + 6))

    room = b.kv_cache_blocks * b.tokens_per_block
    work = [("prompt", n) for n in lengths] + [
        ("decode", (bs, c)) for bs in batches for c in contexts if bs * (c + new_tokens(bs, c) + b.tokens_per_block) <= room]
    for i, (kind, arg) in enumerate(tqdm(work, desc=f"profile {name}", disable=not progress, leave=False)):
        if kind == "prompt":
            engine.add_request(Request(f"p{i}", prompt(arg), 1))
            cached = 0
            while cached < arg:  # a chunk per step: the rest, or the budget rounded down to whole blocks
                size = min(arg - cached, b.max_num_tokens // b.tokens_per_block * b.tokens_per_block)
                t = time.perf_counter()
                engine.step()
                prompted.append((size, size * (cached + (size + 1) / 2), time.perf_counter() - t))
                cached += size
            _steps(engine)
            continue
        batch, context = arg
        for j in range(batch):
            engine.add_request(Request(f"d{i}-{j}", prompt(context), new_tokens(batch, context)))
        while engine.waiting or any(s.num_generated == 0 for s in engine.running.values()):
            engine.step()  # their prompts
        for _ in range(4):
            running = list(engine.running.values())  # the batch as it is, should KV room have cut it short
            if not running:
                break
            t = time.perf_counter()
            engine.step()
            decode.append((len(running), sum(len(s.tokens) for s in running), time.perf_counter() - t))
        for seq in list(engine.running.values()):
            engine.abort(seq.req_id)  # the rest of their tokens would time nothing new
    return fit(decode, prompted)
