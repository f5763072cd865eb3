"""`orchestrator.coalesce_backlog`: the engine responses waiting behind a request go out as one once that
many wait, tokens in order and nothing lost; with 0 (the default) every response goes out on its own, as
the tensorrtllm backend streams. Runs the orchestrator's Hop in-process with a stand-in for the Python stub."""
from __future__ import annotations

import numpy as np
import pytest
from stub_helpers import EngineStream, decode_hop, imported_with_stub


@pytest.fixture(scope="module")
def orchestrator():
    with imported_with_stub("disagg.triton.orchestrator") as module:
        yield module


class Result:
    def __init__(self, tokens):
        self.tokens = tokens

    def as_numpy(self, name):
        return None if name != "output_ids" or self.tokens is None else np.asarray([[self.tokens]], dtype=np.int32)


def _hop(orchestrator, responses: list[list[int]], error: str | None = None):
    """A hop whose engine already sent `responses` (one token list each), then an error or the final one."""
    stream = EngineStream()
    hop = decode_hop(orchestrator, stream)
    for tokens in responses:
        stream.on_response(Result(tokens), None, False)
    stream.on_response(None, error, True) if error else stream.on_response(Result(None), None, True)  # the empty final
    return hop


def test_without_a_backlog_setting_every_response_goes_out_on_its_own(orchestrator):
    hop = _hop(orchestrator, [[t] for t in range(10)])
    assert [ids for ids, _ in hop.results(5.0, lambda: False)] == [[t] for t in range(10)]


def test_a_backlog_goes_out_as_one_response_in_order(orchestrator):
    hop = _hop(orchestrator, [[t] for t in range(10)])
    # the first response finds 9 more waiting behind it, then the end: all go out together
    assert [ids for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=4)] == [list(range(10))]


def test_a_short_backlog_is_not_merged(orchestrator):
    hop = _hop(orchestrator, [[1], [2]])
    assert [ids for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=4)] == [[1], [2]]


def test_an_error_behind_a_backlog_comes_after_its_tokens(orchestrator):
    hop = _hop(orchestrator, [[t] for t in range(6)], error="decode: engine failed")
    got = []
    with pytest.raises(orchestrator.HopError, match="decode: engine failed"):
        for ids, _ in hop.results(5.0, lambda: False, coalesce_backlog=2):
            got.append(ids)
    assert got == [list(range(6))]
