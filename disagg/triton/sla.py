"""Service-level routing: each request has a class with the TTFT and TPOT it must get, each pool of
replicas a cost and a speed the orchestrator measures itself, and a hop goes to the cheapest pool
predicted to meet the class, or is refused, retryably, when none is (rather than queued into a miss).

The speed of a pool is what its hops took against how busy the replica was when each was sent: the
time to first token of its prefill hops, the time per output token of its decode hops, each fitted as
`seconds = a + b * requests in flight` over the pool's recent hops (a constant until two loads were
seen). A pool with fewer than MIN_SAMPLES hops has no prediction and is taken to meet any class: it has
to be tried to be known. A class without targets is served where the load is least, but not on a pool
so close to a stricter class's target that `HEADROOM` more requests would break it.
"""
from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass

MIN_SAMPLES = 3
WINDOW = 64  # hops remembered per pool and phase
HEADROOM = 2  # requests a class without targets leaves free below a stricter class's target


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
    """Seconds per hop (TTFT) or per token (TPOT) of one pool against the requests in flight at dispatch."""

    def __init__(self):
        self._seen: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()

    def observe(self, in_flight: int, seconds: float) -> None:
        with self._lock:
            self._seen.append((in_flight, seconds))

    def predict(self, in_flight: int) -> float | None:
        with self._lock:
            seen = list(self._seen)
        if len(seen) < MIN_SAMPLES:
            return None
        n = sum(x for x, _ in seen) / len(seen)
        t = sum(y for _, y in seen) / len(seen)
        var = sum((x - n) ** 2 for x, _ in seen)
        slope = max(0.0, sum((x - n) * (y - t) for x, y in seen) / var) if var else 0.0
        return max(0.0, t + slope * (in_flight - n))


@dataclass(frozen=True)
class Option:
    """One place a hop can go: `key` is what the caller routes to, `load` its least-loaded order."""

    key: object
    pool: str
    cost: float
    in_flight: int
    load: tuple


class NoPoolMeets(Exception):
    """No pool is predicted to meet the class's target now: retry later, or with a looser class."""


def choose(options: list[Option], speeds: dict[str, Speed], klass: ServiceClass, phase: str,
           strictest: float | None) -> Option:
    """The option a hop of `klass` goes to (see the module's docstring); NoPoolMeets names the best."""
    target = klass.target(phase)

    def predicted(option: Option, extra: int = 0) -> float | None:
        return speeds[option.pool].predict(option.in_flight + 1 + extra) if option.pool in speeds else None

    if target is not None:
        meets = [o for o in options if (p := predicted(o)) is None or p <= target]
        if not meets:
            best = min(options, key=lambda o: predicted(o))
            metric = "time to first token" if phase == "prefill" else "time per output token"
            raise NoPoolMeets(
                f"service class {klass.name!r}: no {phase} pool is predicted to meet its {metric} of "
                f"{target * 1000:g} ms now (best: {predicted(best) * 1000:.0f} ms on {best.pool}): retry shortly"
            )
        return min(meets, key=lambda o: (o.cost, o.load))
    if strictest is not None:
        spare = [o for o in options if (p := predicted(o, HEADROOM)) is None or p <= strictest]
        options = spare or options
    return min(options, key=lambda o: o.load)
