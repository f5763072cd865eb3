"""Service-level routing: each request has a class with the TTFT and TPOT it must get, each pool of
replicas a cost and a speed the orchestrator measures itself, and a hop goes to the cheapest pool
predicted to meet the class, or is refused, retryably, when none is (rather than queued into a miss).

The speed of a pool is what its hops took against how busy the replica was: the time to first token of
its prefill hops against the requests in flight when each was sent, the time per output token of its
decode hops over their first PROBE_TOKENS tokens (a pool is known within a few of its steps, not after
its longest answers) against the mean of the requests in flight when each was sent and when it was
measured (a decode hop's steps are shared with whatever joins it meanwhile), each fitted as `seconds = a + b * requests in
flight` over the pool's recent hops (a constant until two loads were seen; below the fewest requests seen,
its value there: a pool seen only busy is not promised to be faster idle, where a steep line would reach
zero). What is predicted is not the
line but a bound that 19 hops in 20 stay within: the line plus Z standard deviations of the hops seen
around it, since a pool run at a target's mean misses half the time. A pool with fewer than MIN_SAMPLES
hops has no prediction: it has to be tried to be known, so a class with targets counts it as meeting them
while it has no hop in flight (it is tried one hop at a time), and uses it busier only when no measured
pool meets the class. A class without targets is served where the load is least, but not on a pool so
close to a stricter class's target that
`HEADROOM` more requests would break it: a pool that meets the stricter target is kept for the class that
needs it; one that cannot meet it anyway is spare.
"""
from __future__ import annotations

import json
import math
import threading
from collections import deque
from dataclasses import dataclass

MIN_SAMPLES = 3
WINDOW = 64  # hops remembered per pool and phase
HEADROOM = 2  # requests a class without targets leaves free below a stricter class's target
Z = 1.645  # standard deviations above the fitted line: a one-sided 95% bound
PROBE_TOKENS = 8  # a decode hop's time per output token is measured over its first tokens


@dataclass(frozen=True)
class ServiceClass:
    name: str
    ttft_s: float | None = None
    tpot_s: float | None = None

    def target(self, phase: str) -> float | None:
        return self.ttft_s if phase == "prefill" else self.tpot_s


def parse_classes(value: str) -> dict[str, ServiceClass]:
    """The orchestrator's `service_classes` parameter: {"name": {"ttft_ms": .., "tpot_ms": ..}}."""
    raw = json.loads(value or "{}")
    return {
        name: ServiceClass(name, c["ttft_ms"] / 1000 if c.get("ttft_ms") else None, c["tpot_ms"] / 1000 if c.get("tpot_ms") else None)
        for name, c in raw.items()
    }


class Speed:
    """Seconds per hop (TTFT) or per token (TPOT) of one pool against the requests in flight."""

    def __init__(self):
        self._seen: deque[tuple[float, float]] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    def observe(self, in_flight: float, seconds: float) -> None:
        with self._lock:
            self._seen.append((in_flight, seconds))

    def predict(self, in_flight: float) -> float | None:
        """The bound (see the module's docstring) at `in_flight` requests; None before MIN_SAMPLES hops."""
        with self._lock:
            seen = list(self._seen)
        if len(seen) < MIN_SAMPLES:
            return None
        in_flight = max(in_flight, min(x for x, _ in seen))  # below the loads seen, the line where they start
        n = sum(x for x, _ in seen) / len(seen)
        t = sum(y for _, y in seen) / len(seen)
        var = sum((x - n) ** 2 for x, _ in seen)
        slope = max(0.0, sum((x - n) * (y - t) for x, y in seen) / var) if var else 0.0
        spread = math.sqrt(sum((y - t - slope * (x - n)) ** 2 for x, y in seen) / (len(seen) - 1))
        return max(0.0, t + slope * (in_flight - n) + Z * spread)


@dataclass(frozen=True)
class Option:
    """One place a hop can go: `key` is what the caller routes to, `load` its least-loaded order."""

    key: object
    pool: str
    cost: float
    in_flight: int
    load: tuple


@dataclass(frozen=True)
class Phase:
    """One phase a hop must meet its class's target in: its name ("prefill": TTFT, "decode": TPOT), each
    pool's speed in it, and the strictest target any class has there (None: no class has one)."""

    name: str
    speeds: dict[str, Speed]
    strictest: float | None


METRIC = {"prefill": "time to first token", "decode": "time per output token"}


class NoPoolMeets(Exception):
    """No pool is predicted to meet the class's target now: retry later, or with a looser class."""


def choose(options: list[Option], klass: ServiceClass, phases: list[Phase], role: str) -> Option:
    """The option a hop of `klass` goes to (see the module's docstring): a prefill or decode hop has one
    phase, a hop to an aggregated engine both, and its pool must meet the class in each. NoPoolMeets names
    the `role` and the best pool of the phase no pool meets."""

    def predicted(option: Option, phase: Phase, extra: int = 0) -> float | None:
        speed = phase.speeds.get(option.pool)
        return speed.predict(option.in_flight + 1 + extra) if speed is not None else None

    targeted = [(phase, t) for phase in phases if (t := klass.target(phase.name)) is not None]
    if targeted:
        def meets(o: Option) -> bool:  # an unmeasured pool is tried one hop at a time
            return all((o.in_flight == 0) if (p := predicted(o, phase)) is None else p <= t for phase, t in targeted)

        met = [o for o in options if meets(o)]
        if met:
            return min(met, key=lambda o: (o.cost, o.load))
        unmeasured = [o for o in options if any(predicted(o, phase) is None for phase, _ in targeted)]
        if unmeasured:  # no measured pool meets the class, and no prediction says none can: try one anyway
            return min(unmeasured, key=lambda o: o.load)
        for phase, t in targeted:
            if all((p := predicted(o, phase)) is not None and p > t for o in options):
                best = min(options, key=lambda o: predicted(o, phase))
                raise NoPoolMeets(
                    f"service class {klass.name!r}: no {role} pool is predicted to meet its {METRIC[phase.name]} of "
                    f"{t * 1000:g} ms now (best: {predicted(best, phase) * 1000:.0f} ms on {best.pool}): retry shortly"
                )
        both = " and ".join(f"{METRIC[phase.name]} of {t * 1000:g} ms" for phase, t in targeted)
        raise NoPoolMeets(f"service class {klass.name!r}: no {role} pool is predicted to meet both its {both} now: retry shortly")

    def spare(o: Option) -> bool:
        return all((p := predicted(o, phase, HEADROOM)) is None or p <= phase.strictest or predicted(o, phase) > phase.strictest
                   for phase in phases if phase.strictest is not None)

    return min([o for o in options if spare(o)] or options, key=lambda o: o.load)
