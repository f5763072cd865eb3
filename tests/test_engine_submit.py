"""A request is queued for the engine loop without waiting for the step under way, as TensorRT-LLM's
`enqueueRequests` queues for its executor loop; what only the engine's state can refuse is answered through
the request's outputs."""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator

from engine_helpers import EngineFactory

from disagg.engine.engine import Request
from disagg.engine.loop import EngineLoop
from disagg.engine.sampling import NO_END_ID

STEP_S = 0.3


@contextlib.contextmanager
def _mid_step(tmp_path, first: Request, on_output) -> Iterator[EngineLoop]:
    """A loop whose every step takes STEP_S, with `first` submitted and its first step under way."""
    engine = EngineFactory(tmp_path).engine()
    stepping = threading.Event()
    step = engine.step

    def slow():
        stepping.set()
        time.sleep(STEP_S)
        return step()

    engine.step = slow
    loop = EngineLoop(engine)
    try:
        loop.submit(first, on_output)
        assert stepping.wait(10)
        yield loop
    finally:
        loop.stop()


def _request(req_id: str, prompt_len: int, max_new: int) -> Request:
    return Request(req_id, tuple(range(1, prompt_len + 1)), max_new, end_id=NO_END_ID)


def _outputs(q: queue.Queue) -> list:
    got = [q.get(timeout=30)]
    while not got[-1].finished:
        got.append(q.get(timeout=30))
    return got


def test_a_submit_returns_while_a_step_is_under_way_and_the_request_is_served(tmp_path):
    long, new = queue.Queue(), queue.Queue()
    with _mid_step(tmp_path, _request("long", 19, 8), long.put) as loop:
        started = time.perf_counter()
        loop.submit(_request("new", 9, 2), new.put)
        took = time.perf_counter() - started
        assert took < STEP_S / 3, f"submit waited {took * 1e3:.0f} ms, the step under way"
        served = _outputs(new)
        assert sum(len(o.tokens) for o in served) == 2 and served[-1].finish_reason == "length"
        assert sum(len(o.tokens) for o in _outputs(long)) == 8


def test_a_request_submitted_and_aborted_before_the_loop_took_it_in_is_gone(tmp_path):
    long, aborted = queue.Queue(), queue.Queue()
    with _mid_step(tmp_path, _request("long", 19, 4), long.put) as loop:
        loop.submit(_request("gone", 9, 4), aborted.put)
        assert loop.abort("gone")  # found: the abort takes it in first
        _outputs(long)
        assert aborted.empty()
        stats = loop.stats()
        assert (stats.waiting, stats.running, stats.blocks_used) == (0, 0, 0)


def test_an_id_already_in_flight_is_refused_through_the_outputs_and_the_first_goes_on(tmp_path):
    first, second = queue.Queue(), queue.Queue()
    with _mid_step(tmp_path, _request("same", 19, 4), first.put) as loop:
        loop.submit(_request("same", 9, 4), second.put)
        refused = _outputs(second)
        assert [(o.finish_reason, o.error) for o in refused] == [("error", "request id 'same' is already in flight")]
        assert sum(len(o.tokens) for o in _outputs(first)) == 4
        assert loop.stats().delivering == 0


def test_stats_count_a_submitted_request_as_waiting(tmp_path):
    with _mid_step(tmp_path, _request("long", 19, 4), lambda _o: None) as loop:
        loop.submit(_request("next", 9, 4), lambda _o: None)
        assert loop.stats().in_flight == 2
