"""A stand-in for the decoder that costs nothing per token, so the serving stack around it can be measured.

`python -m disagg.bench front` serves the reference engine with `DISAGG_SKIP_COMPUTE=1`: every step returns
logits that make each sequence's next token a fixed function of its last one, without reading weights
or touching the KV cache. Requests, scheduling, KV block bookkeeping and handoffs are those of the real
engine; only the forward pass is gone, so the tokens are not the model's. Never serve it.
`DISAGG_SKIP_COMPUTE_STEP_MS` makes each step take that long without using the CPU, as a GPU's step
would (0: as fast as the engine loop goes, which floods the front with one response per token), and
`DISAGG_SKIP_COMPUTE_TOKEN_MS` adds that much per token the step computes (a prompt's tokens, one per
generating sequence), so a step grows with its batch and prompts as a GPU's does: engines given different
values stand for different GPUs (`python -m disagg.bench sla`'s fast and slow pools, `python -m loadtest
splits --stand-in`'s engines).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import numpy as np

SKIP_COMPUTE_ENV = "DISAGG_SKIP_COMPUTE"
STEP_MS_ENV = "DISAGG_SKIP_COMPUTE_STEP_MS"
TOKEN_MS_ENV = "DISAGG_SKIP_COMPUTE_TOKEN_MS"


def skip_compute() -> bool:
    return os.environ.get(SKIP_COMPUTE_ENV, "") == "1"


def stand_in_env(step_ms: float, token_ms: float = 0.0) -> dict[str, str]:
    """The environment of an engine process whose steps take `step_ms` + `token_ms` per token, off the CPU."""
    return {SKIP_COMPUTE_ENV: "1", STEP_MS_ENV: str(step_ms), TOKEN_MS_ENV: str(token_ms)}


def stand_in_key() -> str:
    """What the environment makes this process's engines: "" where they compute, else their step rule (a cache of
    timings taken on one must not serve the other)."""
    if not skip_compute():
        return ""
    return f"stand-in {os.environ.get(STEP_MS_ENV, '0')} ms + {os.environ.get(TOKEN_MS_ENV, '0')} ms/token"


@contextlib.contextmanager
def skipped_compute(step_ms: float, token_ms: float = 0.0) -> Iterator[None]:
    """Engines made inside, in this process or in servers started inside, skip the forward pass, each step taking
    `step_ms` + `token_ms` per token."""
    new = stand_in_env(step_ms, token_ms)
    old = {name: os.environ.get(name) for name in new}
    os.environ.update(new)
    try:
        yield
    finally:
        for name, value in old.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


class NoComputeModel:
    """`forward` as LlamaModel's: last-token logits per sequence of the step, here one-hot."""

    def __init__(self, vocab_size: int, step_s: float | None = None, token_s: float | None = None):
        self.vocab_size = vocab_size
        self.step_s = float(os.environ.get(STEP_MS_ENV, "0")) / 1e3 if step_s is None else step_s
        self.token_s = float(os.environ.get(TOKEN_MS_ENV, "0")) / 1e3 if token_s is None else token_s

    def forward(self, batch) -> np.ndarray:
        took = self.step_s + self.token_s * sum(len(s.token_ids) for s in batch)
        if took:
            time.sleep(took)
        logits = np.zeros((len(batch), self.vocab_size), dtype=np.float32)
        last = np.fromiter((s.token_ids[-1] for s in batch), dtype=np.int64, count=len(batch))
        logits[np.arange(len(batch)), (last * 31 + 7) % self.vocab_size] = 1.0
        return logits
