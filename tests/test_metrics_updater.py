"""metrics.Updater: the orchestrator's metric updates are applied off the request's thread, a gauge set
many times within a batch is sent once with its last value, and nothing queued is lost at close. And a
model's finalize lets go of every series and family (`release`): one Triton's stub still holds at
shutdown makes it segfault on its way out."""
from __future__ import annotations

import gc
import weakref

import pytest
from stub_helpers import PB_UTILS, imported_with_stub


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


class Family:
    """A pb_utils MetricFamily whose series and itself are counted while alive."""

    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    alive: weakref.WeakSet = weakref.WeakSet()

    def __init__(self, name, description, kind):
        self.alive.add(self)

    def Metric(self, labels, buckets=None):  # noqa: N802 - pb_utils' name
        metric = Recording([], labels.get("request_type", "series"))
        self.alive.add(metric)
        return metric


def test_release_lets_go_of_every_series_and_family_though_the_model_still_holds_its_wrappers(metrics, monkeypatch):
    monkeypatch.setattr(PB_UTILS, "MetricFamily", Family, raising=False)
    engine, backend = metrics.EngineMetrics("decode", "decode_0_0"), metrics.BackendMetrics("decode")
    orchestrator = metrics.Metrics("orchestrator-disaggregated", "orchestrator_0_0", metrics.Updater(period_s=0.01))
    ttft = orchestrator.histogram("disagg_ttft_seconds", "TTFT", [0.1, 1.0])  # as the orchestrator keeps it
    ttft.observe(0.5)
    assert len(Family.alive) > 20
    orchestrator.updater.close()
    for held in (engine, backend, orchestrator):
        held.release()
    gc.collect()
    assert list(Family.alive) == []
    ttft.observe(0.5)  # a request thread still finishing: nothing to update, no error
