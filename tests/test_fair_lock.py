"""The engine loop's lock is handed over in arrival order, so a caller waits for one step, not for a gap."""
from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import EngineFactory

from disagg.engine.engine import Request
from disagg.engine.fair_lock import FairLock
from disagg.engine.loop import EngineLoop
from disagg.engine.sampling import NO_END_ID


def _queued(lock: FairLock, n: int) -> None:
    deadline = time.monotonic() + 10
    while len(lock._waiters) < n:
        assert time.monotonic() < deadline, "the waiters never queued"
        time.sleep(0.001)


def test_a_release_hands_the_lock_to_the_waiter_not_back_to_the_releaser():
    """A plain threading.Lock would let the releasing thread retake it at once: that is the starvation."""
    lock = FairLock()
    lock.acquire()
    got = threading.Event()
    done = threading.Event()

    def waiter():
        with lock:
            got.set()
            done.wait(10)

    thread = threading.Thread(target=waiter)
    thread.start()
    _queued(lock, 1)
    lock.release()
    assert not lock.acquire(blocking=False)  # the waiter holds it now, even if it has not run yet
    assert got.wait(10)
    done.set()
    thread.join(10)
    assert lock.acquire(blocking=False)
    lock.release()


def test_waiters_get_the_lock_in_the_order_they_asked():
    lock = FairLock()
    order: list[int] = []
    lock.acquire()
    threads = []
    for i in range(4):
        thread = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        thread.start()
        _queued(lock, i + 1)
        threads.append(thread)
    lock.release()
    for thread in threads:
        thread.join(10)
    assert order == [0, 1, 2, 3]


def test_a_condition_waits_and_wakes_on_it():
    cond = threading.Condition(FairLock())
    box: list[str] = []

    def consumer():
        with cond:
            assert cond.wait_for(lambda: box, timeout=10)
            box.append("seen")

    thread = threading.Thread(target=consumer)
    thread.start()
    with cond:
        box.append("item")
        cond.notify()
    thread.join(10)
    assert box == ["item", "seen"]


def test_releasing_an_unheld_lock_is_an_error():
    with pytest.raises(RuntimeError, match="unheld FairLock"):
        FairLock().release()


def test_a_caller_waits_for_the_step_under_way_not_for_a_gap_between_steps(tmp_path):
    """The loop retakes its lock right after each step; every call here must get in after at most one more.
    Each step also runs 5 ms of Python, as a served model's step does, so the loop thread keeps the GIL: with a
    plain threading.Lock the caller, woken at the release, finds the lock retaken by the time it has the GIL."""
    engine = EngineFactory(tmp_path).engine()
    steps = [0]
    step = engine.step

    def counted():
        try:
            until = time.perf_counter() + 0.005
            while time.perf_counter() < until:
                pass
            return step()
        finally:
            steps[0] += 1

    engine.step = counted
    loop = EngineLoop(engine)
    done = threading.Event()
    loop.submit(Request("long", tuple(range(1, 20)), 280, end_id=NO_END_ID), lambda out: out.finished and done.set())
    try:
        waited = []
        while not done.is_set() and len(waited) < 100:
            time.sleep(0.002)  # calls arrive at any point of a step, as requests and handoffs do
            before = steps[0]
            loop.stats()
            waited.append(steps[0] - before)
        assert len(waited) == 100 and max(waited) <= 1, waited
    finally:
        loop.stop()
