"""`orchestrator.coalesce_backlog`: while Triton has not yet sent a stream's response, the token responses
that come behind it wait, and go out as one once that many wait, tokens in order and nothing lost; with 0 (the
default) every response goes out on its own, as the tensorrtllm backend streams. Runs the orchestrator's
ClientStream in-process with a stand-in for the Python stub, Triton made slow by holding the stub's lock."""
from __future__ import annotations

import threading
import time

import pytest
from stub_helpers import FINAL, Sender, holding, imported_with_stub


@pytest.fixture(scope="module")
def stubbed():
    """disagg.triton's client_stream and metrics modules, imported against the stand-in stub."""
    with imported_with_stub("disagg.triton.client_stream", "disagg.triton.metrics") as modules:
        yield modules


def _stream(stubbed, backlog: int):
    client_stream, metrics = stubbed
    sender = Sender()
    out = client_stream.ResponseThread("test")
    return client_stream.ClientStream(out, sender, True, "stream", backlog), out, sender


def _new_tokens(got: list) -> list[list[int]]:
    """Each response's tokens, without the ones it repeats as a prefix."""
    return [r.outputs["output_ids"].reshape(-1)[int(r.outputs["prefix_length"][0, 0]):].tolist() for r, _ in got]


def _slowly_sent(stubbed, backlog: int, responses: list[list[int]], end=lambda client: client.finish()):
    """`responses` emitted one by one while Triton cannot send (the stub's lock held), then `end`, then Triton
    sends: what the client got."""
    client, out, sender = _stream(stubbed, backlog)
    release = holding(stubbed[1].STUB_LOCK)
    for tokens in responses:
        client.emit(tokens)
    end(client)
    release.set()
    got = sender.until_final()
    time.sleep(0.1)  # anything that came after the final response would be a fault
    out.close()
    assert sender.sent.empty()
    return got


@pytest.mark.parametrize("backlog", [0, 4])
def test_a_client_that_keeps_up_gets_a_token_per_response(stubbed, backlog):
    client, out, sender = _stream(stubbed, backlog)
    for token in range(5):
        client.emit([token])
        deadline = time.monotonic() + 5
        while sender.sent.qsize() < token + 1 and time.monotonic() < deadline:  # sent before the next comes
            time.sleep(0.001)
    client.finish()
    got = sender.until_final()
    out.close()
    assert _new_tokens(got) == [[0], [1], [2], [3], [4], []]


def test_without_a_backlog_setting_every_response_goes_out_on_its_own_however_slowly_triton_sends(stubbed):
    got = _slowly_sent(stubbed, 0, [[t] for t in range(10)])
    assert _new_tokens(got) == [[t] for t in range(10)] + [[]]


def test_a_backlog_goes_out_as_one_response_in_order(stubbed):
    # 0 is given to Triton; 1-9 wait behind it, at least 4 of them: one response once 0 is sent; then the end
    got = _slowly_sent(stubbed, 4, [[t] for t in range(10)])
    assert _new_tokens(got) == [[0], list(range(1, 10)), []]
    assert [flags for _, flags in got] == [0, 0, FINAL]
    assert got[1][0].outputs["prefix_length"][0, 0] == 1  # the token before it, for a character it finishes


def test_a_short_backlog_is_not_merged(stubbed):
    got = _slowly_sent(stubbed, 4, [[1], [2], [3]])
    assert _new_tokens(got) == [[1], [2], [3], []]


def test_a_long_backlog_sent_one_by_one_does_not_deepen_the_stack(stubbed):
    # fewer waiting than coalesce_backlog: each goes out alone, each send giving the next on the same thread
    got = _slowly_sent(stubbed, 1000, [[t] for t in range(400)])
    assert _new_tokens(got) == [[t] for t in range(400)] + [[]]


def test_no_waiting_token_goes_out_after_an_error(stubbed):
    got = _slowly_sent(stubbed, 2, [[t] for t in range(6)], end=lambda client: client.fail("decode: engine failed"))
    assert _new_tokens(got[:1]) == [[0]]  # in flight when the request failed
    response, flags = got[1]
    assert (response.error.message(), flags) == ("decode: engine failed", FINAL)
    assert len(got) == 2


def test_tokens_and_the_end_from_other_threads_keep_their_order(stubbed):
    """The reader emits while Triton's sends give the waiting responses on the response thread, and the worker
    ends the stream: every token arrives once, in order, before the final response."""
    client, out, sender = _stream(stubbed, 2)

    def reader():
        for token in range(300):
            client.emit([token])
            if token % 7 == 0:
                time.sleep(0.001)

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join(30)
    client.finish()
    got = sender.until_final()
    out.close()
    tokens = _new_tokens(got)
    assert [t for each in tokens for t in each] == list(range(300))
    assert tokens[-1] == []
