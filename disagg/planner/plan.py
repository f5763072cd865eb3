"""The split that serves the most requests per second per instance within the SLOs (DistServe's goodput).

For a budget of engine instances, every prefill:decode split (and each decode batch limit up to the
engine's) and the all-aggregated deployment are simulated under the traffic; the goodput of each is the
highest Poisson rate at which at least `target` of the requests meet both SLOs, found by bisection.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable

import numpy as np

from disagg.planner.profile import StepModel
from disagg.planner.simulate import Deployment, EngineLimits, Host, Orchestrators, SimRequest, poisson_requests, simulate

ATTAINMENT_TARGET = 0.9  # DistServe's goodput: the highest rate at which 90% of requests meet both SLOs
SIMULATED_REQUESTS = 300
SIMULATED_SECONDS = 30.0  # at least this long a run of arrivals: at GPU rates 300 requests end before queues build
GOODPUT_TOLERANCE = 0.02  # the bisection stops once the rate is known within this fraction
MIN_GOODPUT = 1e-3  # requests/s: or within this, where no rate meets the SLOs


@dataclass(frozen=True)
class Traffic:
    """Prompt and output lengths as weighted uniform bins ((weight, min, max), ...), the expected rate and
    the SLOs."""

    prompt_bins: tuple[tuple[float, int, int], ...]
    output_bins: tuple[tuple[float, int, int], ...]
    rate: float
    ttft_slo_s: float
    tpot_slo_s: float

    def requests(self, rate: float, count: int = SIMULATED_REQUESTS, seed: int = 0) -> list[SimRequest]:
        rng = np.random.default_rng(seed)
        return poisson_requests(rate, count, _draw(rng, self.prompt_bins, count), _draw(rng, self.output_bins, count), rng)

    def met(self, r: SimRequest) -> bool:
        return r.ttft <= self.ttft_slo_s and (r.tpot is None or r.tpot <= self.tpot_slo_s)


def _draw(rng: np.random.Generator, bins: tuple[tuple[float, int, int], ...], count: int) -> list[int]:
    """`count` lengths: a bin by weight, then a length uniformly within it."""
    weights = np.array([b[0] for b in bins]) / sum(b[0] for b in bins)
    chosen = rng.choice(len(bins), size=count, p=weights)
    lo, hi = np.array([b[1] for b in bins])[chosen], np.array([b[2] for b in bins])[chosen]
    return [int(n) for n in rng.integers(lo, hi + 1)]


@dataclass(frozen=True)
class Prediction:
    ttft_p50_s: float
    ttft_p95_s: float
    itl_p95_s: float
    attainment: float
    tpot_p50_s: float = 0.0  # over the requests with two tokens or more (0 when none has)


def predict(requests: list[SimRequest], traffic: Traffic) -> Prediction:
    ttft = [r.ttft for r in requests]
    itl = [b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:])] or [0.0]
    tpot = [r.tpot for r in requests if r.tpot is not None] or [0.0]
    return Prediction(float(np.percentile(ttft, 50)), float(np.percentile(ttft, 95)), float(np.percentile(itl, 95)),
                      sum(traffic.met(r) for r in requests) / len(requests), float(np.percentile(tpot, 50)))


@dataclass(frozen=True)
class Option:
    deployment: Deployment
    decode_batch: int | None  # the decode batch limit simulated (None: aggregated)
    goodput: float  # requests/s
    at_rate: Prediction  # at the traffic's own rate

    @property
    def per_instance(self) -> float:
        return self.goodput / self.deployment.instances


def best_first(options: list, shorter_steps: Callable) -> list:
    """Options (each with a `goodput`) most goodput first; among equals (within 2%) by `shorter_steps(option)`,
    smallest first: the smaller batch limit, whose steps are shorter."""
    best = max(o.goodput for o in options) or 1.0
    return sorted(options, key=lambda o: (-round(o.goodput / best * 50), shorter_steps(o)))


class Planner:
    """`hosts`: the CPU each kind of deployment ("aggregated", "disaggregated") runs on, with its front's cost
    per token (None: engines alone, no front). `latency_s`: per kind, how much later than simulated each token
    reaches its client (the hops around the engines, which take no engine's time; calibration measures it).
    `requests` and `seconds`: each simulated run sends as many requests as arrive in that long at its rate, at
    least `requests`. `orchestrators`: how many requests the front lets through to the engines at once (None:
    every one)."""

    def __init__(self, steps: dict[str, StepModel], limits: dict[str, EngineLimits], handoff_s: Callable[[int], float],
                 hosts: dict[str, Host] | None = None, requests: int = SIMULATED_REQUESTS, seconds: float = SIMULATED_SECONDS,
                 latency_s: dict[str, float] | None = None, orchestrators: Orchestrators | None = None):
        self.steps, self.limits, self.handoff_s, self.hosts = steps, limits, handoff_s, hosts or {}
        self.requests, self.seconds, self.latency_s, self.orchestrators = requests, seconds, latency_s or {}, orchestrators

    def adjusted(self, steps: dict[str, StepModel], latency_s: dict[str, float] | None = None) -> Planner:
        """This planner with the given roles' steps, and kinds' latencies, replaced."""
        return Planner({**self.steps, **steps}, self.limits, self.handoff_s, self.hosts, self.requests, self.seconds,
                       {**self.latency_s, **(latency_s or {})}, self.orchestrators)

    def slower(self, factor: float) -> Planner:
        """This planner on a machine running `factor` times slower: every step, and the front's CPU per token."""
        hosts = {kind: replace(host, front_s_per_token=host.front_s_per_token * factor) for kind, host in self.hosts.items()}
        return Planner({role: steps.slower(factor) for role, steps in self.steps.items()}, self.limits, self.handoff_s, hosts,
                       self.requests, self.seconds, self.latency_s, self.orchestrators)

    def fitted(self) -> dict:
        """What its predictions rest on, as JSON: each role's steps, each kind's host and latency, the orchestrators."""
        return {"steps": {role: asdict(steps) for role, steps in self.steps.items()},
                "hosts": {kind: asdict(host) for kind, host in self.hosts.items()}, "latency_s": self.latency_s,
                "orchestrators": asdict(self.orchestrators) if self.orchestrators else None}

    def replay(self, deployment: Deployment, requests: list[SimRequest], decode_batch: int | None = None) -> list[SimRequest]:
        """Given requests (a measured run's, say) through the deployment, with decode's batch limit if given."""
        limits = self.limits
        if decode_batch is not None:
            limits = {**limits, "decode": replace(limits["decode"], max_batch_size=decode_batch)}
        served = simulate(deployment, self.steps, limits, requests, self.handoff_s, self.hosts.get(deployment.kind), self.orchestrators)
        latency = self.latency_s.get(deployment.kind, 0.0)
        if latency:
            for request in served:
                request.token_times[:] = [t + latency for t in request.token_times]
        return served

    def run(self, deployment: Deployment, traffic: Traffic, rate: float, decode_batch: int | None = None) -> list[SimRequest]:
        count = max(self.requests, int(rate * self.seconds))
        return self.replay(deployment, traffic.requests(rate, count), decode_batch)

    def goodput(self, deployment: Deployment, traffic: Traffic, decode_batch: int | None = None) -> float:
        def meets(rate: float) -> bool:
            return predict(self.run(deployment, traffic, rate, decode_batch), traffic).attainment >= ATTAINMENT_TARGET

        lo, hi = 0.0, max(traffic.rate, 0.05)
        while meets(hi) and hi < 1e4:
            lo, hi = hi, hi * 2
        while hi - lo > max(GOODPUT_TOLERANCE * hi, MIN_GOODPUT):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if meets(mid) else (lo, mid)
        return lo

    def deployment_options(self, deployment: Deployment, traffic: Traffic) -> list[Option]:
        """The deployment at each decode batch limit up to the engine's (a split), or as it is (aggregated)."""
        if deployment.aggregated:
            return [Option(deployment, None, self.goodput(deployment, traffic), predict(self.run(deployment, traffic, traffic.rate), traffic))]
        top = self.limits["decode"].max_batch_size
        return [Option(deployment, batch, self.goodput(deployment, traffic, batch),
                       predict(self.run(deployment, traffic, traffic.rate, batch), traffic))
                for batch in sorted({b for b in (8, 16, 32, 64, 128, top) if b <= top})]

    def options(self, instances: int, traffic: Traffic) -> list[Option]:
        """Every split of `instances` (with each decode batch limit) and all-aggregated, best first."""
        return ranked({d: self for d in deployments(instances, "aggregated" in self.steps)}, traffic)


def deployments(instances: int, aggregated: bool = True) -> list[Deployment]:
    """Every prefill:decode split of `instances`, then all-aggregated (where there is an aggregated engine)."""
    splits = [Deployment(prefill=n, decode=instances - n) for n in range(1, instances)]
    return splits + [Deployment(aggregated=instances)] if aggregated else splits


def ranked(planners: dict[Deployment, Planner], traffic: Traffic) -> list[Option]:
    """Each deployment's options as its own planner predicts them (one calibrated on that deployment, say), best first."""
    return best_first([o for d, planner in planners.items() for o in planner.deployment_options(d, traffic)],
                      lambda o: o.decode_batch or 0)
