"""`orchestrator.pool_routing` baselines, in-process: round_robin takes the decode engines in turn whatever
their load, least_loaded the one with the fewest requests in flight, and a decode hop is measured (for
disagg.triton.sla) against the mean of the load it met when sent and when measured."""
from __future__ import annotations

import threading

import pytest
from stub_helpers import imported_with_stub


@pytest.fixture(scope="module")
def routing():
    with imported_with_stub("disagg.triton.routing") as module:
        yield module


def _router(routing, pool_routing: str, loads: dict[str, int]):
    """A router whose decode candidates are two pools' replicas, each at `loads[url]` in flight."""
    router = object.__new__(routing.Router)
    engines = [routing.Engine("decode", url, f"registry:/{url}") for url in loads]
    router.pool_routing, router.decoders, router.dispatched, router._lock, router._turn = pool_routing, ["decode"], {}, threading.Lock(), 0
    router.classes, router.speeds, router.hop_seconds = {"batch": None}, {"prefill": {}, "decode": {}}, {}
    router.candidates = lambda models: list(engines)
    router._score = lambda engine: (False, loads[engine.url] + router.dispatched.get(engine, 0), 0)
    return router


def test_round_robin_takes_each_decode_engine_in_turn_whatever_its_load(routing):
    router = _router(routing, "round_robin", {"10.0.0.2:8001": 0, "10.0.0.1:8001": 50})
    picks = [router.pick_decode().url for _ in range(4)]
    assert picks == ["10.0.0.2:8001", "10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.1:8001"]
    assert sorted(router.dispatched.values()) == [2, 2]


def test_least_loaded_takes_the_engine_with_fewest_in_flight_counting_its_own_dispatches(routing):
    router = _router(routing, "least_loaded", {"10.0.0.1:8001": 3, "10.0.0.2:8001": 1})
    picks = [router.pick_decode().url for _ in range(4)]
    assert picks == ["10.0.0.2:8001", "10.0.0.2:8001", "10.0.0.1:8001", "10.0.0.2:8001"]


def test_a_decode_hop_is_measured_against_the_mean_load_of_its_life(routing):
    router = _router(routing, "service_class", {"10.0.0.1:8001": 7})
    engine = router.candidates(["decode"])[0]
    router.observe("decode", engine, 1, 0.05)  # sent with 1 ahead (2 with itself), 7 in flight as it ends
    router.observe("prefill", engine, 1, 0.2)  # a prefill hop: the load it was sent into, itself included
    assert list(router.speeds["decode"][engine.site]._seen) == [(4.5, 0.05)]
    assert list(router.speeds["prefill"][engine.site]._seen) == [(2, 0.2)]
