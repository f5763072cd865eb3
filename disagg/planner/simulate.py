"""A discrete-event simulation of a deployment under a workload, with profiled step times.

Engines are simulated the way the reference engine (and TensorRT-LLM's inflight batcher) schedules:
each step, every generating sequence computes one token, then prompts are admitted first come first
served while the batch has a slot and the step has token budget (`max_num_tokens`); with chunked
context a prompt that does not fit is cut to what fits, rounded down to `tokens_per_block`. The step
lasts StepModel.step_s of what it computes. Disaggregated: a prompt's first token comes out of a
context-only engine (the least loaded prefill instance), its KV crosses in `handoff_s(tokens)`, and the
least loaded decode instance generates the rest, as the orchestrator routes them. Aggregated: one engine
does both, and the instances of the aggregated engine model take the requests in turn, whatever they hold:
Triton hands a request to the next instance free to take one, and a decoupled model's `execute` returns at
once (replayed, least-loaded put aggregated x4's p50 TTFT 19-28% over measured at 1.5-2 req/s, in turn
within 1%; docs/measurements.md).

With a `Host`, the CPU is shared. Every token then passes through the front (tokenizing, orchestrating,
detokenizing, streaming, the load generator) at `front_s_per_token` of CPU before its client sees it, in
order, and engines that compute on the CPU (the reference engine) run their steps on the same cores: the
runnable work shares them as Linux shares cores between runnable threads (a step as many cores as its
engine keeps busy, `StepModel.cpu_per_wall`; the front up to `FRONT_THREADS`), and steps that only decode
slow each other beyond that (`Host.decode_interference`: three decoding processes on two cores here took
x1.62-1.94 their time alone, where sharing explains x1.5). Without one, engines have
the machine to themselves and tokens arrive as their step ends, as on GPUs with a host whose cores are
not the limit. Requests pass the orchestrator first (`Orchestrators`): each instance serves at most
`max_in_flight` at once, one per worker thread, and the rest wait in its queue until a request it serves
has sent its last token; past that many, the wait is part of TTFT, and the engines hold fewer requests than
have arrived. Not modelled: the KV pool's capacity (a sequence is admitted whatever its blocks) and network
hops.
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


FRONT_THREADS = 4.0  # the processes a token crosses: orchestrator, main tritonserver, postprocessing, client


@dataclass(frozen=True)
class Host:
    """The CPU a deployment runs on: its `cores`, the front's CPU per output token, and whether the engines'
    steps run on those cores too (the reference engine) or on accelerators. `decode_interference`: how much
    longer a step that only decodes takes for each other engine decoding at the same time, beyond sharing the
    cores (decode steps stream every weight from memory; measured by loadtest.plan.hosts)."""

    cores: float
    front_s_per_token: float
    engines_on_cpu: bool = True
    decode_interference: float = 0.0


@dataclass(frozen=True)
class Orchestrators:
    """The orchestrator's `instances` (Triton hands a decoupled model's requests to them in turn) and the
    requests each serves at once (`max_in_flight`, disagg.triton.orchestrator's worker threads)."""

    instances: int
    max_in_flight: int


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
    generated: int = 0  # tokens computed (a client may see them later, through the front)


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
        generating = self.role == "generation_only"
        self.waiting.append(_Seq(req, req.prompt if generating else 0, generating, generated=int(generating)))

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
        self._decoding = decoding
        self.busy = True
        return self.steps.step_s(len(decoding), sum(s.req.prompt + s.generated for s in decoding),
                                 sum(size for _, size in self._chunks),
                                 sum(size * (seq.cached + (size + 1) / 2) for seq, size in self._chunks))

    @property
    def decoding_only(self) -> bool:
        """The planned step computes no prompt token."""
        return not self._chunks

    def finish_step(self) -> tuple[list[SimRequest], list[SimRequest]]:
        """Applies the planned step: the requests that got a token, and those whose context phase ended here
        (to hand off, for a context-only engine)."""
        self.busy = False
        emitted = [seq.req for seq in self._decoding]
        handed = []
        for seq in self._decoding:
            seq.generated += 1
        for seq, size in self._chunks:
            seq.cached += size
            if seq.cached == seq.req.prompt:
                emitted.append(seq.req)  # the first token comes with the prompt's last chunk
                seq.generated, seq.generating = 1, True
                if self.role == "context_only":
                    handed.append(seq.req)
        if self.role == "context_only":
            self.running = [s for s in self.running if not s.generating]
        else:
            self.running = [s for s in self.running if s.generated < s.req.output]
        return emitted, handed


@dataclass(frozen=True)
class Deployment:
    """`prefill` context-only + `decode` generation-only instances, or `aggregated` instances."""

    prefill: int = 0
    decode: int = 0
    aggregated: int = 0

    @property
    def instances(self) -> int:
        return self.prefill + self.decode + self.aggregated

    @property
    def kind(self) -> str:
        return "aggregated" if self.aggregated else "disaggregated"

    def __str__(self) -> str:
        return f"aggregated x{self.aggregated}" if self.aggregated else f"prefill x{self.prefill} + decode x{self.decode}"


class _Cpu:
    """Work sharing `cores`: each job runs at its fair share, at most `threads` cores (water-filling), a decode
    step slower by `interference` for each other decode step running. Jobs are [remaining seconds of one core,
    threads, on_done(now), whether it is a decode step]."""

    def __init__(self, cores: float, interference: float = 0.0):
        self.cores, self.interference = cores, interference
        self.jobs: list[list] = []

    def rates(self) -> list[float]:
        order = sorted(range(len(self.jobs)), key=lambda i: self.jobs[i][1])
        rates, left = [0.0] * len(self.jobs), self.cores
        for k, i in enumerate(order):
            rates[i] = min(self.jobs[i][1], left / (len(order) - k))
            left -= rates[i]
        slowed = 1.0 + self.interference * (sum(job[3] for job in self.jobs) - 1)
        return [rate / slowed if job[3] else rate for job, rate in zip(self.jobs, rates)]

    def run(self, now: float, until: float) -> tuple[float, list]:
        """Runs the jobs from `now` until the first of them ends or `until`, whichever comes first (shares
        do not change in between); returns that time and the on_done of the jobs that ended."""
        if not self.jobs:
            return until, []
        rates = self.rates()
        t = min(until, now + min(job[0] / rate for job, rate in zip(self.jobs, rates)))
        for job, rate in zip(self.jobs, rates):
            job[0] -= rate * (t - now)
        done = [job[2] for job in self.jobs if job[0] <= 1e-9]
        self.jobs = [job for job in self.jobs if job[0] > 1e-9]
        return t, done


class _Front:
    """Streams tokens to clients in the order they were computed, at `s_per_token` of CPU each."""

    def __init__(self, cpu: _Cpu, s_per_token: float, on_last: Callable[[SimRequest, float], None]):
        self.cpu, self.s_per_token, self.on_last = cpu, s_per_token, on_last
        self.queue: deque[list[SimRequest]] = deque()

    def send(self, reqs: list[SimRequest], now: float) -> None:
        if not self.s_per_token:
            self._deliver(reqs, now)
            return
        self.queue.append(reqs)
        if len(self.queue) == 1:
            self._start()

    def _start(self) -> None:
        self.cpu.jobs.append([self.s_per_token * len(self.queue[0]), FRONT_THREADS, self._sent, False])

    def _sent(self, now: float) -> None:
        self._deliver(self.queue.popleft(), now)
        if self.queue:
            self._start()

    def _deliver(self, reqs: list[SimRequest], now: float) -> None:
        for req in reqs:
            req.token_times.append(now)
            if len(req.token_times) == req.output:
                self.on_last(req, now)


def simulate(deployment: Deployment, steps: dict[str, StepModel], limits: dict[str, EngineLimits],
             requests: list[SimRequest], handoff_s: Callable[[int], float], host: Host | None = None,
             orchestrators: Orchestrators | None = None) -> list[SimRequest]:
    """Runs `requests` (arrival order) through the deployment; returns them with the times their client
    saw each token. Without `orchestrators`, every request reaches the engines as it arrives."""
    if deployment.aggregated:
        fronts = [SimEngine("context_and_generation", steps["aggregated"], limits["aggregated"]) for _ in range(deployment.aggregated)]
        backs: list[SimEngine] = []
    else:
        fronts = [SimEngine("context_only", steps["prefill"], limits["prefill"]) for _ in range(deployment.prefill)]
        backs = [SimEngine("generation_only", steps["decode"], limits["decode"]) for _ in range(deployment.decode)]
    cpu = _Cpu(host.cores, host.decode_interference) if host else _Cpu(float("inf"))
    orch = orchestrators or Orchestrators(1, len(requests) or 1)
    serving, queued = [0] * orch.instances, [deque() for _ in range(orch.instances)]
    served_by: dict[int, int] = {}  # id(request) -> the orchestrator instance serving it
    events: list[tuple[float, int, str, object]] = []
    order = 0
    arrived = sent = 0

    def serve(req: SimRequest, now: float) -> None:
        """The orchestrator's worker sends the request to an engine."""
        nonlocal sent
        if deployment.aggregated:  # Triton's instances, in turn
            engine, sent = fronts[sent % len(fronts)], sent + 1
        else:  # the orchestrator's choice, the least loaded
            engine = min(fronts, key=lambda e: e.load)
        engine.add(req)
        kick(engine, now)

    def last_token(req: SimRequest, now: float) -> None:
        """Its worker is free: the next request in that orchestrator's queue takes it."""
        k = served_by.pop(id(req))
        if queued[k]:
            nxt = queued[k].popleft()
            served_by[id(nxt)] = k
            serve(nxt, now)
        else:
            serving[k] -= 1

    front = _Front(cpu, host.front_s_per_token if host else 0.0, last_token)

    def push(t: float, kind: str, what: object) -> None:
        nonlocal order
        heapq.heappush(events, (t, order, kind, what))
        order += 1

    def finished(engine: SimEngine, now: float) -> None:
        emitted, handed = engine.finish_step()
        front.send(emitted, now)
        for req in handed:
            push(now + handoff_s(req.prompt), "handoff", req)
        kick(engine, now)

    def kick(engine: SimEngine, now: float) -> None:
        if not engine.busy:
            duration = engine.start_step()
            if duration is None:
                return
            if host and host.engines_on_cpu:  # alone, it ends after `duration`
                busy = engine.steps.cpu_per_wall
                cpu.jobs.append([duration * busy, busy, lambda t: finished(engine, t), engine.decoding_only])
            else:
                push(now + duration, "step", engine)

    for req in requests:
        push(req.arrival, "arrive", req)
    now = 0.0
    while events or cpu.jobs:
        now, done = cpu.run(now, events[0][0] if events else float("inf"))
        for on_done in done:
            on_done(now)
        while events and events[0][0] <= now:
            _, _, kind, what = heapq.heappop(events)
            if kind == "step":
                finished(what, now)
            elif kind == "arrive":  # to the orchestrator instances in turn
                k, arrived = arrived % orch.instances, arrived + 1
                if serving[k] < orch.max_in_flight:
                    serving[k] += 1
                    served_by[id(what)] = k
                    serve(what, now)
                else:
                    queued[k].append(what)
            else:  # a handoff, to the least loaded decode instance
                engine = min(backs, key=lambda e: e.load)
                engine.add(what)
                kick(engine, now)
    return requests


def poisson_requests(rate: float, count: int, prompts: list[int], outputs: list[int], rng: np.random.Generator) -> list[SimRequest]:
    """`count` requests arriving as a Poisson process of `rate`, the first at 0, with the given lengths."""
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count)) - 1.0 / rate
    return [SimRequest(float(t), p, o) for t, p, o in zip(arrivals, prompts, outputs)]
