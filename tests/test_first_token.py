"""The context phase's first token goes to the client from the engine stream's reader thread, before the
request's worker has it, and never once the worker has left the hop (its answer may be out). Runs the
orchestrator's Hop in-process with a stand-in for the Python stub."""
from __future__ import annotations

import threading

import pytest
from stub_helpers import EngineResult, EngineStream, decode_hop, imported_with_stub


@pytest.fixture(scope="module")
def hop_module():
    with imported_with_stub("disagg.triton.hop") as module:
        yield module


def test_the_first_token_is_handed_on_by_the_reader_before_the_caller_gets_it(hop_module):
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, on_first_token=lambda token: seen.append((token, threading.current_thread().name)))
    reader = threading.Thread(target=lambda: (stream.on_response(EngineResult([7, 8]), None, False),
                                              stream.on_response(EngineResult([9]), None, False),
                                              stream.on_response(EngineResult(None), None, True)), name="reader")
    reader.start()
    reader.join(5)
    assert seen == [(7, "reader")]  # once, the first token only, on the thread that read it
    assert [ids for ids, _ in hop.results(5.0, lambda: False)] == [[7, 8], [9]]  # the caller still gets every token


def test_no_first_token_is_handed_on_after_the_caller_left(hop_module):
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, on_first_token=seen.append)
    hop.leave()  # as a cancelled or timed-out request's worker does before answering the client
    stream.on_response(EngineResult([7]), None, True)
    assert seen == []
    assert hop.results_queue.get_nowait() == ([7], None)


def test_leaving_waits_for_a_first_token_being_handed_on(hop_module):
    stream, entered, release, order = EngineStream(), threading.Event(), threading.Event(), []

    def slow_send(token):
        entered.set()
        release.wait(5)
        order.append("sent")

    hop = decode_hop(hop_module, stream, on_first_token=slow_send)
    reader = threading.Thread(target=stream.on_response, args=(EngineResult([7]), None, True))
    reader.start()
    assert entered.wait(5)
    leaving = threading.Thread(target=lambda: (hop.leave(), order.append("left")))
    leaving.start()
    leaving.join(0.2)
    assert leaving.is_alive()  # the client's final answer, which follows `leave`, cannot overtake the token
    release.set()
    leaving.join(5)
    reader.join(5)
    assert order == ["sent", "left"]


def test_a_fault_in_handing_on_the_first_token_is_raised_to_the_caller(hop_module):
    stream = EngineStream()

    def broken(token):
        raise RuntimeError("detokenizer failed")

    hop = decode_hop(hop_module, stream, on_first_token=broken)
    stream.on_response(EngineResult([7]), None, True)
    with pytest.raises(RuntimeError, match="detokenizer failed"):
        list(hop.results(5.0, lambda: False))
