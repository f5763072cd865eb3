"""The drain of a handoff whose request failed after prefill (disagg.triton.orchestrator `_drain`): it waits
for a decode engine that is coming back, whether its instance is being reloaded or its whole tritonserver
restarted (the soak's SIGSTOP fault), and gives up at once on any other error. The prefill engine holds a
handoff nobody drains until its lease runs out."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest
from stub_helpers import imported_with_stub


@pytest.fixture(scope="module")
def orchestrator():
    with imported_with_stub("disagg.triton.orchestrator") as module:
        yield module


def _draining(orchestrator, errors: list[str]):
    """An orchestrator whose decode hops fail with `errors`, one per try, then succeed; returns it and its tries."""
    model = object.__new__(orchestrator.TritonPythonModel)
    tries: list[dict] = []
    model.decoders = ["decode"]
    model._pick = lambda models: orchestrator.Engine("decode", "127.0.0.1:1")
    model._done = lambda engine: None

    @contextlib.contextmanager
    def hop(engine, inputs, request_id, request_type):
        tries.append({"id": request_id, "type": request_type, "len": int(inputs["request_output_len"][0, 0])})
        if len(tries) <= len(errors):
            raise orchestrator.HopError(errors[len(tries) - 1])
        yield type("Hop", (), {"results": lambda self, timeout_s, cancelled: iter([([7], None)])})()

    model._hop = hop
    return model, tries


def test_a_drain_waits_for_a_decode_server_that_is_restarting(orchestrator):
    model, tries = _draining(orchestrator, [
        "decode: engine instance decode_0_0 (pid 7) died while serving this request",
        "decode: stream to the engine server broke: UNAVAILABLE: failed to connect to all addresses",
        "decode: Request for unknown model: 'decode' has no available versions",
    ])
    model._drain("r1", {"input_ids": np.zeros((1, 3), np.int32)}, np.zeros(4, np.uint8))
    assert tries == [{"id": "r1-drain", "type": "generation_only", "len": 1}] * 4


def test_a_drain_gives_up_at_once_on_an_error_that_waiting_does_not_mend(orchestrator):
    model, tries = _draining(orchestrator, ["decode: context_phase_params: no handoff held under this id"])
    with pytest.raises(orchestrator.HopError, match="no handoff held"):
        model._drain("r1", {}, np.zeros(4, np.uint8))
    assert len(tries) == 1
