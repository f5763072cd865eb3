"""Token selection: greedy, or seeded temperature / top-k / top-p sampling, after the min-tokens mask.

The random stream is derived from (seed, position), not from a generator that advances per call,
so a request sampled partly on a prefill engine and partly on a decode engine draws exactly the
numbers it would have drawn on one aggregated engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# end_id meaning "no token ends the request": how TensorRT-LLM serves `ignore_eos` (its executor worker
# builds the request with `end_id=-1 if sampling_params.ignore_eos`), and what a Triton client sends for it.
NO_END_ID = -1


@dataclass(frozen=True)
class SamplingParams:
    """TensorRT-LLM's conventions: top_k=0 and top_p=0 (the defaults) mean greedy. `min_tokens`: end_id
    cannot be drawn while fewer new tokens than that have been generated (`mask_end_id`)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1 or (self.top_k == 0 and self.top_p == 0.0)

    def validate(self, vocab_size: int) -> None:
        if not (0.0 <= self.temperature <= 100.0) or not np.isfinite(self.temperature):
            raise ValueError(f"temperature: {self.temperature} must be in [0, 100]")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"runtime_top_k: {self.top_k} must be in [0, vocab_size={vocab_size}]")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"runtime_top_p: {self.top_p} must be in [0, 1]")
        if not 0 <= self.seed < 2**64:
            raise ValueError(f"seed: {self.seed} must fit in uint64")
        if self.min_tokens < 0:  # executor SamplingConfig::checkMinTokens
            raise ValueError(f"min_tokens: {self.min_tokens} must be >= 0")


def mask_end_id(logits: np.ndarray, end_id: int | None, generated: int, min_tokens: int) -> np.ndarray:
    """TensorRT-LLM's min-length penalty (kernels/penaltyKernels.cu `batchApplyPenalty`): while the request
    has generated fewer than `min_tokens` new tokens (`currentStep - inputLen < minLength`, sequence length
    minus prompt length), end_id's logit is set to the lowest value, so end_id cannot end it yet. A
    generation-only request counts the context phase's token among its generated ones, as there its
    sequence already holds that token. Returns `logits` itself when nothing is masked, else a copy."""
    if end_id is None or end_id < 0 or generated >= min_tokens:
        return logits
    masked = logits.copy()
    masked[end_id] = -np.inf
    return masked


def sample(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """Picks the token at sequence position `position` from logits [V]."""
    if params.greedy:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / params.temperature
    order = np.argsort(-z, kind="stable")
    if params.top_k > 0:
        order = order[: params.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if 0.0 < params.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    rng = np.random.default_rng([params.seed, position])
    return int(order[rng.choice(len(order), p=probs)])
