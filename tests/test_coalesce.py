"""`orchestrator.coalesce_backlog`: the engine responses waiting behind a request go out as one once that
many wait, tokens in order and nothing lost; with 0 (the default) every response goes out on its own, as
the tensorrtllm backend streams. Runs the orchestrator's Hop in-process with a stand-in for the Python stub."""
from __future__ import annotations

import threading
import time

import pytest
from stub_helpers import EngineResult, EngineStream, Sender, decode_hop, holding, imported_with_stub


@pytest.fixture(scope="module")
def stubbed():
    """disagg.triton's hop, client_stream and metrics modules, imported against the stand-in stub."""
    with imported_with_stub("disagg.triton.hop", "disagg.triton.client_stream", "disagg.triton.metrics") as modules:
        yield modules


def _hop(hop_module, responses: list[list[int]], error: str | None = None):
    """A hop whose engine already sent `responses` (one token list each), then an error or the final one."""
    stream = EngineStream()
    hop = decode_hop(hop_module, stream)
    for tokens in responses:
        stream.on_response(EngineResult(tokens), None, False)
    stream.on_response(None, error, True) if error else stream.on_response(EngineResult(None), None, True)  # the empty final
    return hop


def test_without_a_backlog_setting_every_response_goes_out_on_its_own(stubbed):
    hop = _hop(stubbed[0], [[t] for t in range(10)])
    assert [ids for ids, _ in hop.results(5.0, lambda: False)] == [[t] for t in range(10)]


def test_a_backlog_goes_out_as_one_response_in_order(stubbed):
    hop = _hop(stubbed[0], [[t] for t in range(10)])
    # the first response finds 9 more waiting behind it, then the end: all go out together
    assert [ids for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=4)] == [list(range(10))]


def test_a_short_backlog_is_not_merged(stubbed):
    hop = _hop(stubbed[0], [[1], [2]])
    assert [ids for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=4)] == [[1], [2]]


def test_an_error_behind_a_backlog_comes_after_its_tokens(stubbed):
    hop = _hop(stubbed[0], [[t] for t in range(6)], error="decode: engine failed")
    got = []
    with pytest.raises(stubbed[0].HopError, match="decode: engine failed"):
        for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=2):
            got.append(ids)
    assert got == [list(range(6))]


@pytest.mark.parametrize("backlog", [0, 4])
def test_a_client_that_triton_sends_to_slowly_gets_its_tokens_coalesced(stubbed, backlog):
    """With a backlog setting the stream is paced (a response waits for the one before it to be sent), so
    while Triton is slow to send, the engine's responses wait in the hop and go out together; without one,
    each goes out on its own, however slowly they are sent."""
    sender = Sender()
    hop_module, client_stream, metrics = stubbed
    out = client_stream.ResponseThread("test")
    client = client_stream.ClientStream(out, sender, True, "stream", paced=backlog > 0)
    stream = EngineStream()
    hop = decode_hop(hop_module, stream)

    def serve():
        for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=backlog):
            client.emit(ids)
        client.finish()

    release = holding(metrics.STUB_LOCK)
    worker = threading.Thread(target=serve)
    worker.start()
    stream.on_response(EngineResult([0]), None, False)
    deadline = time.monotonic() + 5
    while not out._queued and time.monotonic() < deadline:  # token 0 queued behind the held lock
        time.sleep(0.001)
    for token in range(1, 10):  # one engine step apart
        stream.on_response(EngineResult([token]), None, False)
        time.sleep(0.02)
    stream.on_response(EngineResult(None), None, True)
    release.set()
    worker.join(10)
    out.close()
    got = sender.until_final()
    new = [r.outputs["output_ids"].reshape(-1)[int(r.outputs["prefix_length"][0, 0]):].tolist() for r, _ in got]
    assert [t for tokens in new for t in tokens] == list(range(10))
    assert new[-1] == []  # the final response
    if backlog:  # 0 alone; then 1, which waited for 0's send while 2-9 came; then 2-9 as one
        assert new[:-1] == [[0], [1], list(range(2, 10))]
    else:
        assert new[:-1] == [[t] for t in range(10)]
