"""Step times of a role's engine, measured on the engine itself and fitted to one linear model.

An engine step's time is modelled as T = base + per_token * N + per_attended * A, where N is the number of
new tokens the step computes (a prompt or chunk's tokens, one per generating sequence) and A the
attention work, the sum over those tokens of the context each attends to. A prefill of n tokens has
N = n, A = n(n+1)/2; a decode step of b sequences at context c has N = b, A = b*c. Weight reads and
matmuls scale with N, attention with A, and `base` is the per-step cost that neither removes. Timed in
this process with the engine's own code (one BLAS thread, as `loadtest compare` serves), the fit's worst
relative error over the timed steps is kept beside it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from disagg.engine.engine import LLMEngine, Request


@dataclass(frozen=True)
class StepModel:
    base_s: float
    per_token_s: float
    per_attended_s: float
    fit_error: float  # the largest |predicted - measured| / measured over the timed steps

    def step_s(self, new_tokens: int, attended: float) -> float:
        return self.base_s + self.per_token_s * new_tokens + self.per_attended_s * attended

    def prefill_s(self, n: int) -> float:
        return self.step_s(n, n * (n + 1) / 2)

    def decode_s(self, batch: int, context: float) -> float:
        return self.step_s(batch, batch * context)


def fit(samples: list[tuple[int, float, float]]) -> StepModel:
    """(N, A, seconds) per timed step -> the least-squares StepModel (relative error weighted)."""
    x = np.array([[1.0, n, a] for n, a, _ in samples])
    y = np.array([s for _, _, s in samples])
    w = 1.0 / y  # relative errors: a 5 ms decode step counts as much as a 2 s prefill
    coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
    coef = np.maximum(coef, 0.0)
    error = float(np.max(np.abs(x @ coef - y) / y))
    return StepModel(float(coef[0]), float(coef[1]), float(coef[2]), error)


def profile_engine(engine_dir: Path, repeats: int = 2, progress: bool = True) -> StepModel:
    """Times whole-prompt prefills at lengths up to the engine's max input length (within one step's
    token budget) and decode steps at batch sizes up to its max batch, then fits the StepModel."""
    engine = LLMEngine(engine_dir)
    b = engine.config.build
    vocab = engine.config.model.vocab_size
    rng = np.random.default_rng(0)
    top = min(b.max_input_len, b.max_num_tokens)
    lengths = sorted({max(8, int(top * f)) for f in (0.05, 0.25, 0.5, 0.75, 1.0)})
    batches = sorted({n for n in (1, 4, 16, b.max_batch_size) if n <= b.max_batch_size})
    contexts = sorted({max(16, int(min(b.max_input_len, b.max_seq_len - 40) * f)) for f in (0.1, 0.9)})

    def prompt(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(2, vocab, n))

    engine.generate([Request("warm", prompt(lengths[0]), 2)])
    samples: list[tuple[int, float, float]] = []
    work = [("prefill", n) for n in lengths for _ in range(repeats)] + [("decode", (bs, c)) for bs in batches for c in contexts]
    for i, (kind, arg) in enumerate(tqdm(work, desc=f"profile {engine_dir.name}", disable=not progress, leave=False)):
        if kind == "prefill":
            engine.add_request(Request(f"p{i}", prompt(arg), 1))
            t = time.perf_counter()
            while engine.has_work():
                engine.step()
            samples.append((arg, arg * (arg + 1) / 2, time.perf_counter() - t))
            continue
        batch, context = arg
        for j in range(batch):
            engine.add_request(Request(f"d{i}-{j}", prompt(context), 6))
        while any(s.num_generated == 0 for s in engine.running.values()) or engine.waiting:
            engine.step()  # the prefills, timed above
        for _ in range(4):
            t = time.perf_counter()
            engine.step()
            samples.append((batch, batch * (context + 2), time.perf_counter() - t))
        while engine.has_work():
            engine.step()
    return fit(samples)
