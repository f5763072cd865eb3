"""Tokens go to the client from the engine stream's reader thread: the context phase's first token before the
request's worker has it, a decode hop's every token without the worker getting them, and none once the worker
has left the hop (its answer may be out). Runs the orchestrator's Hop in-process with a stand-in for the
Python stub."""
from __future__ import annotations

import threading
import time

import pytest
from stub_helpers import EngineResult, EngineStream, decode_hop, imported_with_stub


@pytest.fixture(scope="module")
def hop_module():
    with imported_with_stub("disagg.triton.hop") as module:
        yield module


def _answered_on_a_reader(hop_module, option: str):
    """A hop with `option` (on_first_token or on_tokens) recording what it is handed and on which thread, and
    its engine's answer ([7, 8], [9], the end) read on a thread named "reader"."""
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, **{option: lambda tokens: seen.append((tokens, threading.current_thread().name))})
    reader = threading.Thread(target=lambda: (stream.on_response(EngineResult([7, 8]), None, False),
                                              stream.on_response(EngineResult([9]), None, False),
                                              stream.on_response(EngineResult(None), None, True)), name="reader")
    reader.start()
    reader.join(5)
    return hop, seen


def test_the_first_token_is_handed_on_by_the_reader_before_the_caller_gets_it(hop_module):
    hop, seen = _answered_on_a_reader(hop_module, "on_first_token")
    assert seen == [([7], "reader")]  # once, the first token only, on the thread that read it
    assert [ids for ids, _ in hop.results(5.0, lambda: False)] == [[7, 8], [9]]  # the caller still gets every token


def test_no_first_token_is_handed_on_after_the_caller_left(hop_module):
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, on_first_token=seen.append)
    hop.leave()  # as a cancelled or timed-out request's worker does before answering the client
    stream.on_response(EngineResult([7]), None, True)
    assert seen == []
    assert hop.results_queue.get_nowait() == ([7], None)


def test_every_token_is_handed_on_by_the_reader_and_the_caller_waits_only_for_the_end(hop_module):
    hop, seen = _answered_on_a_reader(hop_module, "on_tokens")
    assert seen == [([7, 8], "reader"), ([9], "reader")]
    assert list(hop.results(5.0, lambda: False)) == []  # nothing left for the caller but the end


def test_a_hop_whose_tokens_are_handed_on_times_out_only_when_they_stop(hop_module):
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, on_tokens=seen.extend)

    def engine():
        for token in range(10):  # a token every 0.1 s for 1 s: twice the timeout, never a gap as long
            stream.on_response(EngineResult([token]), None, False)
            time.sleep(0.1)
        stream.on_response(EngineResult(None), None, True)

    reader = threading.Thread(target=engine, name="reader")
    reader.start()
    assert list(hop.results(0.5, lambda: False)) == []
    reader.join(5)
    assert seen == list(range(10))

    quiet = decode_hop(hop_module, EngineStream(), on_tokens=seen.extend)
    started = time.monotonic()
    with pytest.raises(hop_module.HopError, match="decode: no response within 0.3 s"):
        list(quiet.results(0.3, lambda: False))
    assert 0.3 <= time.monotonic() - started < 2.0


def test_no_token_is_handed_on_after_the_caller_left(hop_module):
    stream, seen = EngineStream(), []
    hop = decode_hop(hop_module, stream, on_tokens=seen.extend)
    stream.on_response(EngineResult([7]), None, False)
    hop.leave()
    stream.on_response(EngineResult([8]), None, True)
    assert seen == [7]


def test_leaving_waits_for_a_token_being_handed_on(hop_module):
    stream, entered, release, order = EngineStream(), threading.Event(), threading.Event(), []

    def slow_send(tokens):
        entered.set()
        release.wait(5)
        order.append("sent")

    hop = decode_hop(hop_module, stream, on_tokens=slow_send)
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


def test_a_fault_in_handing_on_tokens_is_raised_to_the_caller(hop_module):
    stream = EngineStream()

    def broken(tokens):
        raise RuntimeError("detokenizer failed")

    for option in ("on_first_token", "on_tokens"):
        hop = decode_hop(hop_module, stream, **{option: broken})
        stream.on_response(EngineResult([7]), None, True)
        with pytest.raises(RuntimeError, match="detokenizer failed"):
            list(hop.results(5.0, lambda: False))
