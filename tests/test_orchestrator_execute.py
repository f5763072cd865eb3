"""The orchestrator's `execute` starts each request and hands it to a worker without waiting for the stub's lock,
which the response thread holds while it sends a batch of responses; with the Python stub stood in for."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

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


class Observed(list):
    """A histogram that keeps what it observed, and on which thread."""

    def observe(self, value: float) -> None:
        self.append((value, threading.current_thread()))


class Served:
    """A model whose `_serve` records on which thread each request got up to its first hop's send, and on
    which it went on after it."""

    def __init__(self, orchestrator, busy: int = 0, max_in_flight: int = 4):
        model = orchestrator.TritonPythonModel.__new__(orchestrator.TritonPythonModel)
        model.read_inputs = {"input_ids"}
        model._lock, model._handed, model.max_in_flight = threading.Lock(), busy, max_in_flight
        model.workers = ThreadPoolExecutor(max_workers=max_in_flight)
        model.first_hop = Observed()
        self.model, self.sent_on, self.rest_on, self.done = model, [], [], threading.Event()
        self.arrays, self.senders = [], []

        def serve(arrays, sender, arrival):
            self.arrays.append(arrays)
            self.senders.append(sender)
            self.sent_on.append(threading.current_thread())
            yield orchestrator.SENT
            self.rest_on.append(threading.current_thread())
            self.done.set()

        model._serve = serve


def test_execute_starts_requests_while_the_stubs_lock_is_held_and_a_worker_serves_the_rest(orchestrator):
    served = Served(orchestrator)
    request = Request(input_ids=np.asarray([[5, 6, 7]], dtype=np.int32), not_read=np.zeros(1))
    release = holding(orchestrator.STUB_LOCK)  # as the response thread holds it through a batch of sends
    try:
        executed = threading.Thread(target=served.model.execute, args=([request],), daemon=True)
        executed.start()
        executed.join(2)
        assert not executed.is_alive(), "execute waited for the stub's lock"
    finally:
        release.set()
    assert served.done.wait(5)
    assert served.sent_on == [executed], "the first hop was not sent from execute"
    assert served.rest_on[0] not in (executed, threading.current_thread()), "no worker served the rest"
    [arrays] = served.arrays
    assert served.senders == [request.sender]
    assert sorted(arrays) == ["input_ids", "service_class"]
    assert arrays["input_ids"].tolist() == [[5, 6, 7]] and arrays["service_class"].tolist() == [[b"batch"]]
    served.model.workers.shutdown()
    assert served.model._handed == 0, "the worker was not given back"
    [(seconds, on)] = served.model.first_hop  # arrival -> the first hop's send, timed where it was sent
    assert 0 < seconds < 2 and on is executed


def test_with_every_worker_busy_a_request_starts_on_its_worker(orchestrator):
    served = Served(orchestrator, busy=4, max_in_flight=4)
    request = Request(input_ids=np.asarray([[5]], dtype=np.int32))
    served.model.execute([request])
    assert served.done.wait(5)
    assert served.sent_on == served.rest_on and served.sent_on[0] is not threading.current_thread()
    served.model.workers.shutdown()
    assert served.model._handed == 4
    [(seconds, on)] = served.model.first_hop  # its wait for the worker included
    assert 0 < seconds < 5 and on is served.sent_on[0]


def test_a_fault_before_the_first_hop_gives_its_worker_back(orchestrator):
    served = Served(orchestrator)

    def broken(arrays, sender, arrival):
        raise KeyError("input_lengths")
        yield

    served.model._serve = broken
    with pytest.raises(KeyError):
        served.model.execute([Request(input_ids=np.asarray([[5]], dtype=np.int32))])
    served.model.workers.shutdown()
    assert served.model._handed == 0 and served.model.first_hop == []  # no hop sent: nothing timed
