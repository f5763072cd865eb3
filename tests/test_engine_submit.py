"""A request is queued for the engine loop without waiting for the step under way, as TensorRT-LLM's
`enqueueRequests` queues for its executor loop; what only the engine's state can refuse is answered through
the request's outputs."""
from __future__ import annotations

import queue
import threading
import time

from engine_helpers import EngineFactory

from disagg.engine.engine import Request
from disagg.engine.loop import EngineLoop
from disagg.engine.sampling import NO_END_ID

STEP_S = 0.3


def _slow_loop(tmp_path) -> tuple[EngineLoop, threading.Event]:
    """A loop whose every step takes STEP_S; the event is set once a step is under way."""
    engine = EngineFactory(tmp_path).engine()
    stepping = threading.Event()
    step = engine.step

    def slow():
        stepping.set()
        time.sleep(STEP_S)
        return step()

    engine.step = slow
    return EngineLoop(engine), stepping


def _outputs(q: queue.Queue) -> list:
    got = [q.get(timeout=30)]
    while not got[-1].finished:
        got.append(q.get(timeout=30))
    return got


def test_a_submit_returns_while_a_step_is_under_way_and_the_request_is_served(tmp_path):
    loop, stepping = _slow_loop(tmp_path)
    try:
        long, new = queue.Queue(), queue.Queue()
        loop.submit(Request("long", tuple(range(1, 20)), 8, end_id=NO_END_ID), long.put)
        assert stepping.wait(10)
        started = time.perf_counter()
        loop.submit(Request("new", tuple(range(1, 10)), 2, end_id=NO_END_ID), new.put)
        took = time.perf_counter() - started
        assert took < STEP_S / 3, f"submit waited {took * 1e3:.0f} ms, the step under way"
        served = _outputs(new)
        assert sum(len(o.tokens) for o in served) == 2 and served[-1].finish_reason == "length"
        assert sum(len(o.tokens) for o in _outputs(long)) == 8
    finally:
        loop.stop()


def test_a_request_submitted_and_aborted_before_the_loop_took_it_in_is_gone(tmp_path):
    loop, stepping = _slow_loop(tmp_path)
    try:
        long, aborted = queue.Queue(), queue.Queue()
        loop.submit(Request("long", tuple(range(1, 20)), 4, end_id=NO_END_ID), long.put)
        assert stepping.wait(10)
        loop.submit(Request("gone", tuple(range(1, 10)), 4, end_id=NO_END_ID), aborted.put)
        assert loop.abort("gone")  # found: the abort takes it in first
        _outputs(long)
        assert aborted.empty()
        stats = loop.stats()
        assert (stats.waiting, stats.running, stats.blocks_used) == (0, 0, 0)
    finally:
        loop.stop()


def test_an_id_already_in_flight_is_refused_through_the_outputs_and_the_first_goes_on(tmp_path):
    loop, stepping = _slow_loop(tmp_path)
    try:
        first, second = queue.Queue(), queue.Queue()
        loop.submit(Request("same", tuple(range(1, 20)), 4, end_id=NO_END_ID), first.put)
        assert stepping.wait(10)
        loop.submit(Request("same", tuple(range(1, 10)), 4, end_id=NO_END_ID), second.put)
        refused = _outputs(second)
        assert [(o.finish_reason, o.error) for o in refused] == [("error", "request id 'same' is already in flight")]
        assert sum(len(o.tokens) for o in _outputs(first)) == 4
        assert loop.stats().delivering == 0
    finally:
        loop.stop()


def test_stats_count_a_submitted_request_as_waiting(tmp_path):
    loop, stepping = _slow_loop(tmp_path)
    try:
        loop.submit(Request("long", tuple(range(1, 20)), 4, end_id=NO_END_ID), lambda _o: None)
        assert stepping.wait(10)
        loop.submit(Request("next", tuple(range(1, 10)), 4, end_id=NO_END_ID), lambda _o: None)
        assert loop.stats().in_flight == 2
    finally:
        loop.stop()
