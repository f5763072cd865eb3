"""A discrete-event simulation of a deployment under a workload, with profiled step times.

Engines are simulated the way the reference engine (and TensorRT-LLM's inflight batcher) schedules:
each step, every generating sequence computes one token, then prompts are admitted first come first
served while the batch has a slot and the step has token budget (`max_num_tokens`); with chunked
context a prompt that does not fit is cut to what fits, rounded down to `tokens_per_block`. The step
lasts StepModel.step_s of what it computes. Disaggregated: a prompt's first token comes out of a
context-only engine (the least loaded prefill instance), its KV crosses in `handoff_s(tokens)`, and the
least loaded decode instance generates the rest. Aggregated: one engine does both. Not modelled: the
KV pool's capacity (a sequence is admitted whatever its blocks), the front end's own CPU (tokenizing,
streaming), and network hops.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from disagg.planner.profile import StepModel


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int
    max_num_tokens: int
    chunked: bool
    tokens_per_block: int


@dataclass
class SimRequest:
    arrival: float
    prompt: int
    output: int
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


@dataclass
class _Seq:
    req: SimRequest
    cached: int  # tokens whose KV is in this engine
    generating: bool


class SimEngine:
    """One engine instance: `role` context_only, generation_only or context_and_generation."""

    def __init__(self, role: str, steps: StepModel, limits: EngineLimits):
        self.role, self.steps, self.limits = role, steps, limits
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.busy = False
        self._chunks: list[tuple[_Seq, int]] = []
        self._decoding: list[_Seq] = []

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: SimRequest) -> None:
        cached = req.prompt if self.role == "generation_only" else 0
        self.waiting.append(_Seq(req, cached, generating=self.role == "generation_only"))

    def start_step(self) -> float | None:
        """Plans the next step; its duration, or None when there is nothing to do."""
        lim = self.limits
        admit_budget = lim.max_num_tokens - len(self.running)
        while self.waiting and len(self.running) < lim.max_batch_size:
            seq = self.waiting[0]
            need = 1 if seq.generating else seq.req.prompt - seq.cached
            if need > admit_budget and not lim.chunked:
                break
            self.running.append(self.waiting.popleft())
            admit_budget -= need
        decoding = [s for s in self.running if s.generating]
        budget = lim.max_num_tokens - len(decoding)
        self._chunks = []
        for seq in self.running:
            if seq.generating:
                continue
            rest = seq.req.prompt - seq.cached
            size = rest if rest <= budget else (budget // lim.tokens_per_block * lim.tokens_per_block if lim.chunked else 0)
            if size > 0:
                self._chunks.append((seq, size))
                budget -= size
        if not decoding and not self._chunks:
            return None
        new = len(decoding) + sum(size for _, size in self._chunks)
        attended = sum(s.req.prompt + len(s.req.token_times) for s in decoding)
        attended += sum(size * (seq.cached + (size + 1) / 2) for seq, size in self._chunks)
        self._decoding = decoding
        self.busy = True
        return self.steps.step_s(new, attended, prompt_tokens=bool(self._chunks))

    def finish_step(self, now: float) -> list[SimRequest]:
        """Applies the planned step at `now`; returns the requests whose context phase ended here (to hand
        off, for a context-only engine)."""
        self.busy = False
        handed = []
        for seq in self._decoding:
            seq.req.token_times.append(now)
        for seq, size in self._chunks:
            seq.cached += size
            if seq.cached == seq.req.prompt:
                seq.req.token_times.append(now)  # the first token comes with the prompt's last chunk
                seq.generating = True
                if self.role == "context_only":
                    handed.append(seq.req)
        self.running = [s for s in self.running if not self._done(s)]
        return handed

    def _done(self, seq: _Seq) -> bool:
        if self.role == "context_only":
            return seq.generating
        return len(seq.req.token_times) >= seq.req.output


@dataclass(frozen=True)
class Deployment:
    """`prefill` context-only + `decode` generation-only instances, or `aggregated` instances."""

    prefill: int = 0
    decode: int = 0
    aggregated: int = 0

    @property
    def instances(self) -> int:
        return self.prefill + self.decode + self.aggregated

    def __str__(self) -> str:
        return f"aggregated x{self.aggregated}" if self.aggregated else f"prefill x{self.prefill} + decode x{self.decode}"


def simulate(deployment: Deployment, steps: dict[str, StepModel], limits: dict[str, EngineLimits],
             requests: list[SimRequest], handoff_s: Callable[[int], float]) -> list[SimRequest]:
    """Runs `requests` (arrival order) through the deployment; returns them with their token times."""
    if deployment.aggregated:
        fronts = [SimEngine("context_and_generation", steps["aggregated"], limits["aggregated"]) for _ in range(deployment.aggregated)]
        backs: list[SimEngine] = []
    else:
        fronts = [SimEngine("context_only", steps["prefill"], limits["prefill"]) for _ in range(deployment.prefill)]
        backs = [SimEngine("generation_only", steps["decode"], limits["decode"]) for _ in range(deployment.decode)]
    events: list[tuple[float, int, str, object]] = []
    order = 0

    def push(t: float, kind: str, what: object) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, what))
        order += 1

    def kick(engine: SimEngine, now: float) -> None:
        if not engine.busy:
            duration = engine.start_step()
            if duration is not None:
                push(now + duration, "step", engine)

    for req in requests:
        push(req.arrival, "arrive", req)
    while events:
        now, _, kind, what = heapq.heappop(events)
        if kind == "arrive":
            engine = min(fronts, key=lambda e: e.load)
            engine.add(what)
            kick(engine, now)
        elif kind == "handoff":
            engine = min(backs, key=lambda e: e.load)
            engine.add(what)
            kick(engine, now)
        else:
            for req in what.finish_step(now):
                push(now + handoff_s(req.prompt), "handoff", req)
            kick(what, now)
    return requests


def poisson_requests(rate: float, count: int, prompt: Callable[[np.random.Generator], int],
                     output: Callable[[np.random.Generator], int], seed: int = 0) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count)) - 1.0 / rate
    return [SimRequest(float(t), prompt(rng), output(rng)) for t in arrivals]
