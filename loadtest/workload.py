"""Workloads as data: a YAML file in loadtest/workloads/ -> a fixed, seeded list of requests and arrivals.

Prompt lengths are in tokens of the served model's tokenizer (`tokenizer.json`), counted as the
server's preprocessing counts them (disagg/text.py `encode_prompt`: the special tokens the tokenizer's
post-processor adds, such as BOS, included unless the deployment sets `model.add_special_tokens: false`),
because the limit a prompt must fit (max_input_len) is in those tokens and the tiny byte-level BPE spends
~3.4 tokens per English word. The same seed gives the same prompts, output lengths and arrival times in
every run, so the aggregated and disaggregated deployments see identical traffic.

    name: mixed
    seed: 0
    prompt_tokens: [{weight: 0.7, min: 8, max: 32}, {weight: 0.3, min: 150, max: 200}]
    output_tokens: [{weight: 1.0, min: 32, max: 64}]     # max_tokens per request
    exact_output_tokens: false        # optional: true sends min_tokens = max_tokens, so end_id ends no answer early
    shared_prefix: {fraction: 0.3, tokens: 24}             # added before the sampled prompt
    arrival: {rate: 2.0, users: 32}   # rate: Poisson requests/s (open loop); no rate: closed loop
    sweep_rates: [1, 2, 4]            # optional: the rates `python -m loadtest compare` sweeps
    duration_s: 60                    # each run stops at whichever bound comes first
    max_requests: 120
    slo: {ttft_ms: 500, tpot_ms: 50}
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import yaml

from disagg.text import encode_prompt

WORKLOAD_DIR = Path(__file__).resolve().parent / "workloads"

# Plain English words; prompts are random sequences of them (the tiny model's output is noise anyway,
# what matters is the token count and a realistic byte-level BPE split).
WORDS = tuple("""
the of and to in is was for on that with as it by at from this be are have not but they his her which
you one all were we when there can an your their if has more will would so about what up out them into
some time could other than then its only new like people over also first two may after way these many
any where through water long little very words called just most know get made part place year
live back give good man think day how great say help low line turn cause much mean before move right boy
old same tell does set three want air well play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need house picture try
again animal point mother world near build self earth father head stand own page should country found
answer school grow study still learn plant cover food sun four between state keep eye never last let
thought city tree cross farm hard start might story saw far sea draw left late run while press close
night real life few north open seem together next white children begin got walk example ease paper group
always music those both mark often letter until mile river car feet care second book carry took science
eat room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main
""".split())


@dataclass(frozen=True)
class LengthBin:
    """`weight` of the requests draw a length uniformly from [min, max]."""

    weight: float
    min: int
    max: int


@dataclass(frozen=True)
class Request:
    index: int
    prompt: str
    prompt_tokens: int  # as the server's preprocessing counts them (special tokens included, if it adds them)
    max_tokens: int
    shared_prefix: bool


@dataclass(frozen=True)
class Workload:
    name: str
    seed: int
    prompt_tokens: tuple[LengthBin, ...]
    output_tokens: tuple[LengthBin, ...]
    shared_prefix_fraction: float
    shared_prefix_tokens: int
    rate: float | None  # requests/s, Poisson arrivals; None: closed loop (each user sends back to back)
    users: int
    duration_s: float
    max_requests: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    sweep_rates: tuple[float, ...] = ()
    exact_output_tokens: bool = False  # every answer as long as drawn (genai-perf's ignore_eos), not ended by end_id

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt this workload can send (shared prefix included), for checks against max_input_len."""
        return max(b.max for b in self.prompt_tokens) + (self.shared_prefix_tokens if self.shared_prefix_fraction else 0)

    def with_rate(self, rate: float | None) -> Workload:
        return replace(self, rate=rate)

    def arrivals(self) -> list[float]:
        """Open loop: planned send times (s after start) of requests 0..max_requests-1, Poisson at `rate`."""
        assert self.rate is not None, "closed-loop workloads have no arrival schedule"
        gaps = np.random.default_rng([self.seed, 1]).exponential(1.0 / self.rate, self.max_requests)
        return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()

    def open_loop_users(self) -> int:
        """Users enough that no send waits for a free one: as many as requests planned within the run, at least
        `users`. With fewer, a deployment slower than the rate turns the open loop closed: sends fall behind
        their schedule, the wait is in no latency, and requests planned last are never sent (a run planned at
        4.2 req/s with 32 users sent 185 of its 252 requests, 3.1 req/s, and met the SLOs for 99% of them)."""
        if not self.rate:
            return self.users
        return max(self.users, sum(t < self.duration_s for t in self.arrivals()))

    def requests(self, tokenizer_path: str | Path, add_special_tokens: bool = True) -> list[Request]:
        """The `max_requests` requests of a run, each built to its drawn token length. `add_special_tokens`:
        the served deployment's `model.add_special_tokens`."""
        return PromptBuilder(tokenizer_path, self, add_special_tokens).requests()


def _bins(raw: list[dict], key: str) -> tuple[LengthBin, ...]:
    bins = tuple(LengthBin(float(b["weight"]), int(b["min"]), int(b["max"])) for b in raw)
    if not bins or any(b.weight <= 0 or not 1 <= b.min <= b.max for b in bins):
        raise ValueError(f"{key}: each bin needs weight > 0 and 1 <= min <= max")
    return bins


def workload_file(name_or_path: str | Path) -> Path:
    """A workload's file: the path itself, or by name from loadtest/workloads/ (`mixed` -> mixed.yaml)."""
    path = Path(name_or_path)
    return path if path.is_file() else WORKLOAD_DIR / f"{name_or_path}.yaml"


def workload_variant(base: Path, out: Path, suffix: str, **changes) -> tuple[Path, Workload]:
    """`base`'s workload renamed `<name>-<suffix>`, its top-level keys replaced by `changes` (a mapping is
    updated key by key), written to <out>/<name>.yaml: a run reads its workload from a file."""
    raw = yaml.safe_load(base.read_text())
    raw["name"] = f"{raw['name']}-{suffix}"
    for key, value in changes.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    path = out / f"{raw['name']}.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, load_workload(path)


def load_workload(name_or_path: str | Path) -> Workload:
    path = workload_file(name_or_path)
    raw = yaml.safe_load(path.read_text())
    prefix = raw.get("shared_prefix", {})
    arrival = raw["arrival"]
    workload = Workload(
        name=raw["name"],
        seed=int(raw.get("seed", 0)),
        prompt_tokens=_bins(raw["prompt_tokens"], "prompt_tokens"),
        output_tokens=_bins(raw["output_tokens"], "output_tokens"),
        shared_prefix_fraction=float(prefix.get("fraction", 0.0)),
        shared_prefix_tokens=int(prefix.get("tokens", 0)),
        rate=float(arrival["rate"]) if arrival.get("rate") else None,
        users=int(arrival["users"]),
        duration_s=float(raw["duration_s"]),
        max_requests=int(raw["max_requests"]),
        ttft_slo_ms=float(raw["slo"]["ttft_ms"]),
        tpot_slo_ms=float(raw["slo"]["tpot_ms"]),
        sweep_rates=tuple(float(r) for r in raw.get("sweep_rates", ())),
        exact_output_tokens=bool(raw.get("exact_output_tokens", False)),
    )
    if not 0 <= workload.shared_prefix_fraction <= 1:
        raise ValueError(f"{path}: shared_prefix.fraction must be in [0, 1]")
    if workload.users < 1 or workload.max_requests < 1 or workload.duration_s <= 0:
        raise ValueError(f"{path}: arrival.users, max_requests and duration_s must be positive")
    return workload


class PromptBuilder:
    """Builds prompts of an exact token budget from WORDS: the longest word prefix that fits.

    The byte-level pre-tokenizer splits at spaces, so words tokenize independently and the count of a
    prefix is monotone in its length: a binary search over the number of words finds the fit. Counts are
    the server's (`encode_prompt`): a budget includes the special tokens the tokenizer adds."""

    def __init__(self, tokenizer_path: str | Path, workload: Workload, add_special_tokens: bool = True):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.add_special_tokens = add_special_tokens
        self.workload = workload
        self.rng = np.random.default_rng([workload.seed, 0])

    def count(self, text: str) -> int:
        return len(encode_prompt(self.tokenizer, text, self.add_special_tokens))

    def text(self, budget: int) -> str:
        words = [WORDS[i] for i in self.rng.integers(len(WORDS), size=budget)]  # every word is >= 1 token
        lo, hi = 0, budget
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.count(" ".join(words[:mid])) <= budget else (lo, mid - 1)
        return " ".join(words[: max(lo, 1)])

    def draw(self, bins: tuple[LengthBin, ...]) -> int:
        weights = np.array([b.weight for b in bins])
        b = bins[self.rng.choice(len(bins), p=weights / weights.sum())]
        return int(self.rng.integers(b.min, b.max + 1))

    def requests(self) -> list[Request]:
        w = self.workload
        system_prompt = self.text(w.shared_prefix_tokens) if w.shared_prefix_tokens else ""
        out = []
        for i in range(w.max_requests):
            body = self.text(self.draw(w.prompt_tokens))
            shared = bool(system_prompt) and self.rng.random() < w.shared_prefix_fraction
            prompt = f"{system_prompt} {body}" if shared else body
            out.append(Request(i, prompt, self.count(prompt), self.draw(w.output_tokens), shared))
        return out
