"""Step times of a role's engine, measured on the engine itself: a table for steps that only generate,
a linear model for steps with prompt tokens.

A step that computes only generating sequences' tokens costs `decode`: at each profiled batch size N,
base + per_attended * A, with A the attention work (the sum of their contexts); between profiled sizes,
linear in N. A table, not one line in N: on a CPU one sequence's matmuls are vector-matrix products and
two or more sequences' are matrix-matrix products, dearer per weight read (bench-100mb here, ~1k-token
contexts: 19.5 ms at batch 1, 53.5 ms at 2, 65 ms at 3, 68 ms at 4), which a line through batch 1 and 4
missed by half. A step with prompt tokens (a prefill, or a chunk beside the decodes) is bound by the
matmuls over all its new tokens: `prompt`, base + per_token * new + per_attended * P, where a prompt or
chunk of n tokens after o cached ones attends to P = n * (o + (n + 1) / 2); its decodes' attention is
added at the decode table's rate. Timed in this process with the engine's own code (one BLAS thread, as
`loadtest compare` serves); decode batches get their contexts by importing one prefilled prompt's KV, as
a generation-only request does, so no batch waits for its prompts. The worst relative error over the
timed steps is kept beside the model. Where the environment makes the engines stand-ins for GPUs
(disagg.engine.no_compute), the stand-in is what is timed, as the engine models would serve it.
"""
from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits
from tqdm import tqdm

from disagg.engine.engine import ContextPhase, LLMEngine, Request, Status
from disagg.engine.no_compute import skip_compute


@dataclass(frozen=True)
class Timed:
    """One timed step: its generating sequences and their summed contexts, its prompt tokens and their
    attention work."""

    decodes: int
    decode_attended: float
    prompt_tokens: int
    prompt_attended: float
    seconds: float


@dataclass(frozen=True)
class Linear:
    base_s: float
    per_token_s: float
    per_attended_s: float

    def __call__(self, new_tokens: int, attended: float) -> float:
        return self.base_s + self.per_token_s * new_tokens + self.per_attended_s * attended


@dataclass(frozen=True)
class DecodeTable:
    batches: tuple[int, ...]
    base_s: tuple[float, ...]
    per_attended_s: tuple[float, ...]

    def _at(self, values: tuple[float, ...], batch: int) -> float:
        """values at `batch`: linear between the profiled sizes around it, the nearest one outside them
        (plain Python: the simulation asks for every step)."""
        sizes = self.batches
        i = bisect.bisect_left(sizes, batch)
        if i == 0:
            return values[0]
        if i == len(sizes):
            return values[-1]
        lo, hi = sizes[i - 1], sizes[i]
        return values[i - 1] + (values[i] - values[i - 1]) * (batch - lo) / (hi - lo)

    def per_attended(self, batch: int) -> float:
        return self._at(self.per_attended_s, batch)

    def __call__(self, batch: int, attended: float) -> float:
        return self._at(self.base_s, batch) + self.per_attended(batch) * attended


@dataclass(frozen=True)
class StepModel:
    decode: DecodeTable
    prompt: Linear
    fit_error: float  # the largest |predicted - measured| / measured over the timed steps
    # Cores the engine's process keeps busy while a step runs alone: 1 as profiled (one BLAS thread); served,
    # less where the step loop waits within a step, more where the process's other threads work beside it
    # (measured by calibration, loadtest.calibration.calibrated). What a step takes from cores it shares.
    cpu_per_wall: float = 1.0
    # What serving adds to a step for each generating sequence after the first: 0 as profiled (the engine alone);
    # served, each sequence's token is a response the engine's process sends, and the processes carrying the
    # tokens likely slow the step through the memory they share with it, the more the more tokens a step makes
    # (measured by calibration with a batch of requests).
    per_sequence_s: float = 0.0

    def step_s(self, decodes: int, decode_attended: float, prompt_tokens: int = 0, prompt_attended: float = 0.0) -> float:
        serving = self.per_sequence_s * max(decodes - 1, 0)
        if not prompt_tokens:
            return self.decode(decodes, decode_attended) + serving
        prompt = self.prompt(decodes + prompt_tokens, prompt_attended)
        return prompt + self.decode.per_attended(decodes) * decode_attended + serving

    def prefill_s(self, n: int) -> float:
        return self.step_s(0, 0.0, n, n * (n + 1) / 2)

    def decode_s(self, batch: int, context: float) -> float:
        return self.step_s(batch, batch * context)

    def with_decode_overhead(self, seconds: float) -> StepModel:
        """Steps that only generate `seconds` longer each, whatever their batch (shorter where negative, never
        under a tenth of the profiled step); steps with prompt tokens as they were."""
        d = self.decode
        base = tuple(max(v + seconds, 0.1 * v) for v in d.base_s)
        return replace(self, decode=DecodeTable(d.batches, base, d.per_attended_s))

    def decode_scaled(self, factor: float) -> StepModel:
        """Decode work `factor` times as long (steps that only decode, and the decodes beside a prompt's tokens);
        the prompt's work as it was."""
        d = self.decode
        return replace(self, decode=DecodeTable(d.batches, tuple(v * factor for v in d.base_s), tuple(v * factor for v in d.per_attended_s)),
                       per_sequence_s=self.per_sequence_s * factor)

    def slower(self, factor: float) -> StepModel:
        """Every step `factor` times as long: the same engine on a machine running that much slower."""
        q = self.prompt
        return replace(self.decode_scaled(factor), prompt=Linear(q.base_s * factor, q.per_token_s * factor, q.per_attended_s * factor))

    @classmethod
    def from_dict(cls, raw: dict) -> StepModel:
        table = DecodeTable(*(tuple(raw["decode"][k]) for k in ("batches", "base_s", "per_attended_s")))
        return cls(table, Linear(**raw["prompt"]), raw["fit_error"], raw.get("cpu_per_wall", 1.0), raw.get("per_sequence_s", 0.0))


def fit_decode(steps: list[Timed]) -> DecodeTable:
    """Per batch size, the least-squares line in the attention work (relative errors); a batch timed at one
    context only (the KV pool too small for the longer one) takes its neighbour's slope."""
    batches = sorted({s.decodes for s in steps})
    slopes: dict[int, float] = {}
    for b in batches:
        mine = [s for s in steps if s.decodes == b]
        attended = [s.decode_attended for s in mine]
        if max(attended) >= 2 * min(attended):  # two contexts, not one growing a token a step
            x = np.array([[1.0, s.decode_attended] for s in mine])
            y = np.array([s.seconds for s in mine])
            coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
            slopes[b] = max(float(coef[1]), 0.0)
    if not slopes:
        raise ValueError("decode steps timed at one context only: no attention slope")
    known = sorted(slopes)
    slope = [slopes.get(b, slopes[min(known, key=lambda k: abs(k - b))]) for b in batches]
    base = [float(np.median([s.seconds - a * s.decode_attended for s in steps if s.decodes == b])) for b, a in zip(batches, slope)]
    return DecodeTable(tuple(batches), tuple(max(v, 0.0) for v in base), tuple(slope))


def fit_prompt(steps: list[Timed], decode: DecodeTable) -> Linear:
    """The least-squares Linear over steps with prompt tokens, their decodes' attention taken out first."""
    x = np.array([[1.0, s.decodes + s.prompt_tokens, s.prompt_attended] for s in steps])
    y = np.array([s.seconds - decode.per_attended(s.decodes) * s.decode_attended for s in steps])
    w = np.array([s.seconds for s in steps])  # relative errors: a 5 ms step counts as much as a 2 s one
    coef, *_ = np.linalg.lstsq(x / w[:, None], y / w, rcond=None)
    return Linear(*(max(float(c), 0.0) for c in coef))


def fit(steps: list[Timed]) -> StepModel:
    decode = fit_decode([s for s in steps if not s.prompt_tokens])
    model = StepModel(decode, fit_prompt([s for s in steps if s.prompt_tokens], decode), 0.0)
    worst = max(abs(model.step_s(s.decodes, s.decode_attended, s.prompt_tokens, s.prompt_attended) - s.seconds) / s.seconds
                for s in steps)
    return replace(model, fit_error=float(worst))


def profile_engine(engine_dir: Path, progress: bool = True) -> StepModel:
    """Times prompts (whole, or chunk by chunk where the engine chunks them) at lengths up to the engine's
    max input length, decode steps at batch sizes up to its max batch and two context lengths (DECODE_PASSES
    passes over them), and, where it chunks prompts, chunks beside a batch of decodes. One BLAS thread, as the
    engine model serves (disagg.triton.engine_model), and its stand-in where DISAGG_SKIP_COMPUTE makes one."""
    with threadpool_limits(1, user_api="blas"):
        return Profiler(LLMEngine(engine_dir, skip_compute=skip_compute())).run(engine_dir.name, progress)


DECODE_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PROMPT_REPEATS = 3  # timings of each prompt length, the median kept
TIMED_STEPS = 4
# Passes over every decode batch size, their steps fitted together: this machine's speed drifts over the tens of
# seconds a pass takes. Three profilings each, batch 24 over 560-token contexts: 62.5-87.4 ms with one pass,
# 84.2-91.1 ms with three.
DECODE_PASSES = 3
PROMPTING = (Status.WAITING, Status.CONTEXT)


class Profiler:
    """Runs an engine step by step and records each step's work and time (`steps`): the prompts, prefilled
    contexts and imported batches that `profile_engine` times, and `python -m disagg.bench corun` too."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.build = engine.config.build
        self.rng = np.random.default_rng(0)
        self.steps: list[Timed] = []
        self._ids = 0

    def _id(self) -> str:
        self._ids += 1
        return f"profile-{self._ids}"

    def _prompt(self, n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in self.rng.integers(2, self.engine.config.model.vocab_size, n))

    def timed_step(self) -> None:
        """One step, recorded with what it computed (read from the engine's own sequences)."""
        e = self.engine
        decoding = [s for s in e.running.values() if s.status is Status.RUNNING]
        prompting = {s.req_id: s.num_cached for s in [*e.running.values(), *e.waiting] if s.status in PROMPTING}
        t = time.perf_counter()
        e.step()
        seconds = time.perf_counter() - t
        sizes = [(e.find(req_id).num_cached - before, before) for req_id, before in prompting.items()]
        self.steps.append(Timed(len(decoding), float(sum(len(s.tokens) for s in decoding)), sum(n for n, _ in sizes),
                                sum(n * (o + (n + 1) / 2) for n, o in sizes), seconds))

    def prompt_steps(self, n: int, request_type: str = "context_and_generation") -> str:
        """A prompt of n tokens, every step of its context phase timed; its id (held or generating: its caller
        releases or aborts it)."""
        req_id = self._id()
        self.engine.add_request(Request(req_id, self._prompt(n), 2, request_type))
        while self.engine.find(req_id).status in PROMPTING:
            self.timed_step()
        return req_id

    def prefilled(self, context: int) -> tuple[tuple[int, ...], ContextPhase]:
        """A prompt of `context` tokens and its KV, as a generation-only request takes them."""
        e = self.engine
        req_id = self.prompt_steps(context, "context_only")
        seq = e.held[req_id]
        phase = ContextPhase(seq.tokens[-1], e.export_kv(req_id))
        e.release(req_id)
        return tuple(seq.request.prompt_ids), phase

    def import_batch(self, batch: int, prompt: tuple[int, ...], context: ContextPhase, new_tokens: int) -> list[str]:
        """`batch` generation-only sequences continuing from `context`, past their first (untimed) step."""
        ids = [self._id() for _ in range(batch)]
        for req_id in ids:
            self.engine.add_request(Request(req_id, prompt, new_tokens, "generation_only", context=context))
        self.engine.step()
        return ids

    def _decode_steps(self, batch: int, prompt: tuple[int, ...], context: ContextPhase) -> None:
        ids = self.import_batch(batch, prompt, context, 2 * TIMED_STEPS)
        for _ in range(TIMED_STEPS):
            self.timed_step()
        for req_id in ids:
            self.engine.abort(req_id)

    def _mixed_steps(self, decodes: int, prompt: tuple[int, ...], context: ContextPhase) -> None:
        """A prompt of three chunks beside `decodes` generating sequences, which outlive it."""
        b = self.build
        chunk = (b.max_num_tokens - decodes) // b.tokens_per_block * b.tokens_per_block
        if chunk <= 0:
            return
        length = min(3 * chunk, b.max_input_len, b.max_seq_len - 2)
        ids = self.import_batch(decodes, prompt, context, -(-length // chunk) + 4)
        ids.append(self.prompt_steps(length))
        for req_id in ids:
            self.engine.abort(req_id)

    def _typical(self, timed) -> None:
        """Runs `timed` PROMPT_REPEATS times and keeps the steps of the run whose total is the median: a prompt
        is one step, or a few, and this machine's speed moves tens of percent from one to the next."""
        runs = []
        for _ in range(PROMPT_REPEATS):
            before = len(self.steps)
            timed()
            runs.append(self.steps[before:])
            del self.steps[before:]
        self.steps += sorted(runs, key=lambda steps: sum(s.seconds for s in steps))[len(runs) // 2]

    def run(self, name: str, progress: bool) -> StepModel:
        b = self.build
        longest = min(b.max_input_len, b.max_seq_len - 16)
        lengths = sorted({max(8, int(longest * f)) for f in (0.05, 0.25, 0.5, 1.0)})
        lengths = [n for n in lengths if n <= b.max_num_tokens or b.enable_chunked_context]
        contexts = sorted({max(16, int(longest * f)) for f in (0.1, 0.8)})
        room = b.kv_cache_blocks * b.tokens_per_block
        batches = [n for n in DECODE_BATCHES if n <= b.max_batch_size]
        decode_work = [(n, c) for n in batches for c in contexts if n * (c + 2 * TIMED_STEPS + b.tokens_per_block) <= room]
        mixed = [n for n in (1, 4, 16) if n < b.max_batch_size] if b.enable_chunked_context else []
        work = [("prompt", n) for n in lengths] + [("decode", w) for w in decode_work] * DECODE_PASSES + [("mixed", n) for n in mixed]
        self.engine.generate([Request("warm", self._prompt(lengths[0]), 2)])
        prefilled: dict[int, tuple[tuple[int, ...], ContextPhase]] = {}
        for kind, arg in tqdm(work, desc=f"profile {name}", disable=not progress, leave=False):
            if kind == "prompt":
                self._typical(lambda n=arg: self.engine.abort(self.prompt_steps(n)))
                continue
            batch, context = arg if kind == "decode" else (arg, contexts[0])
            if context not in prefilled:
                prefilled[context] = self.prefilled(context)
            (self._decode_steps if kind == "decode" else self._mixed_steps)(batch, *prefilled[context])
        return fit(self.steps)


class SpeedProbe:
    """How fast this machine runs an engine alone now against when the probe was made: a prompt and a few decode
    steps of a small batch, timed (the median of PROBE_ROUNDS), read between load runs while nothing else
    computes, so that a reader can tell a machine that drifted from a model that missed (here a decode step took
    12% longer two hours after its profile). Alone only: what a step costs while other processes compute beside
    it is another matter (docs/measurements.md)."""

    def __init__(self, engine_dir: Path, context: int = 512, batch: int = 2):
        with threadpool_limits(1, user_api="blas"):
            self.profiler = Profiler(LLMEngine(engine_dir, skip_compute=skip_compute()))
            self.context = min(context, self.profiler.build.max_input_len, self.profiler.build.max_seq_len - 2 * PROBE_STEPS - 2)
            self.batch = min(batch, self.profiler.build.max_batch_size)
            self.prompt, self.phase = self.profiler.prefilled(self.context)
        self.reference = self.seconds()

    def seconds(self) -> float:
        """The probe's steps, timed now."""
        with threadpool_limits(1, user_api="blas"):
            return float(np.median([self._once() for _ in range(PROBE_ROUNDS)]))

    def slowdown(self) -> float:
        """Now against when the probe was made: 1.2 is a machine running 20% slower."""
        return self.seconds() / self.reference

    def _once(self) -> float:
        p = self.profiler
        p.steps.clear()
        p.engine.release(p.prompt_steps(self.context, "context_only"))
        ids = p.import_batch(self.batch, self.prompt, self.phase, 2 * PROBE_STEPS)
        for _ in range(PROBE_STEPS):
            p.timed_step()
        for req_id in ids:
            p.engine.abort(req_id)
        seconds = sum(s.seconds for s in p.steps)
        p.steps.clear()
        return seconds


PROBE_ROUNDS = 3
PROBE_STEPS = 8
