"""disagg.triton.response_thread: every client response of a model sent from one thread, in the order queued,
with the Python stub stood in for."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from stub_helpers import FINAL, Sender, imported_with_stub


@pytest.fixture(scope="module")
def module():
    with imported_with_stub("disagg.triton.response_thread") as module:
        yield module


def _tokens(response) -> list[int]:
    return response.outputs["output_ids"].tolist()


def test_responses_of_many_streams_go_out_each_in_its_order(module):
    gate = threading.Event()
    held, other = Sender(gate), Sender()
    out = module.ResponseThread("test")
    sent_then = []
    out.send(held, {"output_ids": np.asarray([0])})  # held at its send until the gate opens
    for token in range(1, 6):
        out.send(other, {"output_ids": np.asarray([token])}, then=lambda token=token: sent_then.append(token))
    out.fail(other, "stopped")
    gate.set()
    out.close()
    assert [_tokens(r) for r, _ in [held.sent.get(timeout=5)]] == [[0]]
    got = other.until_final()
    assert [_tokens(r) for r, _ in got[:-1]] == [[1], [2], [3], [4], [5]]
    assert got[-1][0].error.message() == "stopped" and got[-1][1] == FINAL
    assert sent_then == [1, 2, 3, 4, 5]


def test_a_send_that_raises_is_logged_and_the_next_responses_still_go_out(module, monkeypatch):
    logged = []
    monkeypatch.setattr(module.pb_utils, "Logger", type("Logger", (), {"log_error": staticmethod(logged.append)}), raising=False)

    class Gone(Sender):
        def send(self, response=None, flags=0):
            raise RuntimeError("Unable to send response. Response sender has been closed.")

    out, fine, then = module.ResponseThread("orchestrator_0"), Sender(), []
    out.send(Gone(), {"output_ids": np.asarray([1])}, then=lambda: then.append("gone"))
    out.send(fine, {"output_ids": np.asarray([2])}, FINAL, then=lambda: then.append("fine"))
    out.close()
    assert [(_tokens(r), flags) for r, flags in fine.until_final()] == [([2], FINAL)]
    assert then == ["gone", "fine"]
    assert len(logged) == 1 and logged[0].startswith("orchestrator_0: a response was not sent") and "sender has been closed" in logged[0]


def test_after_close_a_response_is_dropped_and_its_waiter_released(module):
    out, sender, then = module.ResponseThread("test"), Sender(), []
    out.close()
    out.send(sender, {"output_ids": np.asarray([1])}, then=lambda: then.append(1))
    assert then == [1] and sender.sent.empty()
