"""disagg.triton.response_thread: a model's client responses sent at once when the stub is free, else queued
for one thread, each stream's in order; with the Python stub stood in for."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from stub_helpers import FINAL, Sender, holding, imported_with_stub


@pytest.fixture(scope="module")
def module():
    with imported_with_stub("disagg.triton.response_thread") as module:
        yield module


class Recording(Sender):
    """Also records which thread sent each response."""

    def __init__(self):
        super().__init__()
        self.threads: list[str] = []

    def send(self, response=None, flags=0):
        self.threads.append(threading.current_thread().name)
        super().send(response, flags)


def _tokens(response) -> list[int]:
    return response.outputs["output_ids"].tolist()


def test_with_the_stub_free_a_response_goes_out_on_the_callers_thread(module):
    out, sender, then = module.ResponseThread("test"), Recording(), []
    out.send(sender, {"output_ids": np.asarray([1])}, then=lambda: then.append(1))
    assert then == [1]  # sent before send returned
    out.close()
    assert [_tokens(r) for r, _ in [sender.sent.get_nowait()]] == [[1]]
    assert sender.threads == [threading.current_thread().name]


def test_with_the_stub_busy_responses_are_queued_and_each_stream_keeps_its_order(module):
    out, a, b = module.ResponseThread("test"), Recording(), Recording()
    release = holding(module.STUB_LOCK)
    for token in range(1, 4):
        out.send(a, {"output_ids": np.asarray([token])})
        out.send(b, {"output_ids": np.asarray([10 + token])})
    release.set()
    out.send(a, {"output_ids": np.asarray([4])})  # queued behind a's others whether or not they are out yet
    out.fail(a, "stopped")
    out.close()
    got = a.until_final()
    assert [_tokens(r) for r, _ in got[:-1]] == [[1], [2], [3], [4]]
    assert got[-1][0].error.message() == "stopped" and got[-1][1] == FINAL
    assert [_tokens(r) for r in [b.sent.get_nowait()[0] for _ in range(3)]] == [[11], [12], [13]]
    assert set(a.threads[:3] + b.threads) == {"client-responses"}


def test_with_the_stub_free_a_stream_with_a_response_queued_queues_the_next(module):
    out, a, other = module.ResponseThread("test"), Recording(), Sender()
    inside_then, go_on = threading.Event(), threading.Event()

    def stall():  # runs on the response thread, outside the stub's lock: the thread is held, the lock free
        inside_then.set()
        go_on.wait(10)

    release = holding(module.STUB_LOCK)
    out.send(other, {"output_ids": np.asarray([0])}, then=stall)
    deadline = time.monotonic() + 5
    while not out._queue.empty() and time.monotonic() < deadline:  # until the thread has taken it, to wait for the lock
        time.sleep(0.001)
    out.send(a, {"output_ids": np.asarray([1])})  # queued for the thread's next round
    release.set()
    assert inside_then.wait(5)
    out.send(a, {"output_ids": np.asarray([2])})  # the lock is free, but 1 is not out yet
    assert a.sent.empty()
    go_on.set()
    out.close()
    assert [_tokens(a.sent.get_nowait()[0]) for _ in range(2)] == [[1], [2]]
    assert a.threads == ["client-responses"] * 2


def test_a_send_that_raises_is_logged_and_the_next_responses_still_go_out(module, monkeypatch):
    logged = []
    monkeypatch.setattr(module.pb_utils, "Logger", type("Logger", (), {"log_error": staticmethod(logged.append)}), raising=False)

    class Gone(Sender):
        def send(self, response=None, flags=0):
            raise RuntimeError("Unable to send response. Response sender has been closed.")

    out, fine, then = module.ResponseThread("orchestrator_0"), Sender(), []
    release = holding(module.STUB_LOCK)
    out.send(Gone(), {"output_ids": np.asarray([1])}, then=lambda: then.append("gone"))
    out.send(fine, {"output_ids": np.asarray([2])}, FINAL, then=lambda: then.append("fine"))
    release.set()
    out.close()
    assert [(_tokens(r), flags) for r, flags in fine.until_final()] == [([2], FINAL)]
    assert then == ["gone", "fine"]
    assert len(logged) == 1 and logged[0].startswith("orchestrator_0: a response was not sent") and "sender has been closed" in logged[0]


def test_after_close_a_response_is_dropped_and_its_waiter_released(module):
    out, sender, then = module.ResponseThread("test"), Sender(), []
    out.close()
    out.send(sender, {"output_ids": np.asarray([1])}, then=lambda: then.append(1))
    assert then == [1] and sender.sent.empty()
