"""metrics.Updater: the orchestrator's metric updates are applied off the request's thread, a gauge set
many times within a batch is sent once with its last value, and nothing queued is lost at close."""
from __future__ import annotations

import pytest
from stub_helpers import imported_with_stub


@pytest.fixture(scope="module")
def metrics():
    with imported_with_stub("disagg.triton.metrics") as module:
        yield module


class Recording:
    """A pb_utils Metric that records its calls (each one an IPC round trip in the real stub)."""

    def __init__(self, calls: list, name: str):
        self.calls, self.name = calls, name

    def set(self, value):
        self.calls.append((self.name, "set", value))

    def increment(self, value):
        self.calls.append((self.name, "increment", value))

    def observe(self, value):
        self.calls.append((self.name, "observe", value))


def test_a_batch_sends_each_gauge_once_and_every_count_and_observation(metrics):
    calls: list = []
    updater = metrics.Updater(period_s=0.2)
    gauge, counter, histogram = (metrics._Metric(Recording(calls, n), updater) for n in ("gauge", "counter", "ttft"))
    for value in (1, 2, 3):
        gauge.set(value)
    counter.increment(1)
    histogram.observe(0.25)
    counter.increment(2)
    assert calls == []  # nothing on the caller's thread
    updater.close()
    assert calls == [("counter", "increment", 1), ("ttft", "observe", 0.25), ("counter", "increment", 2), ("gauge", "set", 3)]
