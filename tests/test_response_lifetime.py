"""Models hold a response's tensors until Triton has sent it (disagg.triton.responses).

Triton 2.51's Python backend drops the outputs a request did not ask for with the GIL released; a tensor
whose last reference went with them was freed there and broke the stub's heap. The stand-in response here
keeps only weak references to its tensors, as the backend's pruning leaves them, and the sender records at
each send how many of them the model still holds."""
from __future__ import annotations

import weakref

import pytest
from stub_helpers import PB_UTILS, imported_with_stub

from disagg.engine.sampling import SamplingParams
from disagg.triton.tensors import EngineCall


class PrunedResponse:
    def __init__(self, output_tensors=None, error=None):
        self.tensors = [weakref.ref(t) for t in output_tensors or []]
        self.error = error


class Sender:
    def __init__(self):
        self.sends: list[tuple[int, int]] = []  # (tensors in the response, those still alive at the send)

    def send(self, response=None, flags=0):
        self.sends.append((len(response.tensors), sum(ref() is not None for ref in response.tensors)))

    def is_cancelled(self):
        return False


@pytest.fixture
def pruning(monkeypatch):
    monkeypatch.setattr(PB_UTILS, "InferenceResponse", PrunedResponse)


def test_the_engine_model_holds_its_tensors_through_each_send(pruning):
    call = EngineCall(request_id="r", request_type="context_and_generation", input_ids=(1, 2, 3), max_new_tokens=4,
                      streaming=True, sampling=SamplingParams(), end_id=None, stop=False, return_perf_metrics=True,
                      context_phase_params=None)
    with imported_with_stub("disagg.triton.engine_model") as engine_model:
        sender = Sender()
        stream = engine_model.Stream(sender, call)
        stream.respond((7,), final=False)
        stream.respond((8,), final=True)
    # output_ids and sequence_length, then those and the three perf-metrics times
    assert sender.sends == [(2, 2), (5, 5)]


def test_the_orchestrator_holds_its_tensors_through_each_send(pruning):
    with imported_with_stub("disagg.triton.client_stream") as client_stream:
        sender = Sender()
        out = client_stream.ResponseThread("test")
        client = client_stream.ClientStream(out, sender, True, "stream")
        client.emit([5, 6])
        client.finish()
        out.close()
    assert sender.sends == [(5, 5), (5, 5)]
