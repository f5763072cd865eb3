"""The orchestrator's `execute` hands each request to a worker without waiting for the stub's lock, which the
response thread holds while it sends a batch of responses; with the Python stub stood in for."""
from __future__ import annotations

import json
import queue
import threading
import types

import numpy as np
import pytest
from stub_helpers import Sender, Tensor, holding, imported_with_stub


@pytest.fixture(scope="module")
def orchestrator():
    with imported_with_stub("disagg.triton.orchestrator") as module:
        yield module


class Request:
    def __init__(self, **inputs):
        self._inputs = [Tensor(name, array) for name, array in inputs.items()]
        self.sender = Sender()

    def inputs(self):
        return self._inputs

    def parameters(self):
        return json.dumps({"service_class": "batch"})

    def get_response_sender(self):
        return self.sender


def test_execute_hands_requests_on_while_the_stubs_lock_is_held(orchestrator):
    model = orchestrator.TritonPythonModel.__new__(orchestrator.TritonPythonModel)
    model.read_inputs = {"input_ids"}
    handed: queue.Queue = queue.Queue()
    model.workers = types.SimpleNamespace(submit=lambda _serve, arrays, sender, _arrival: handed.put((arrays, sender)))
    request = Request(input_ids=np.asarray([[5, 6, 7]], dtype=np.int32), not_read=np.zeros(1))
    release = holding(orchestrator.STUB_LOCK)  # as the response thread holds it through a batch of sends
    try:
        executed = threading.Thread(target=model.execute, args=([request],), daemon=True)
        executed.start()
        executed.join(2)
        assert not executed.is_alive(), "execute waited for the stub's lock"
    finally:
        release.set()
    arrays, sender = handed.get_nowait()
    assert sender is request.sender
    assert sorted(arrays) == ["input_ids", "service_class"]
    assert arrays["input_ids"].tolist() == [[5, 6, 7]] and arrays["service_class"].tolist() == [[b"batch"]]
