"""How the orchestrator ends requests that go wrong, in-process.

The drain of a handoff whose request failed after prefill (`_drain`) waits for a decode engine that is
coming back, whether its instance is being reloaded or its whole tritonserver restarted (the soak's SIGSTOP
fault), and gives up at once on any other error: the prefill engine holds a handoff nobody drains until its
lease runs out. Which hop errors mean "coming back" (`HopError.engine_away`) is decided where they arise: a
broken stream or connection (EngineGone), an engine server that has not loaded the model yet. A fault of the orchestrator's own still
ends the client's request with an error: its worker would swallow the exception, and the request (an
ensemble's, too) would stay in flight until the server stops.
"""
from __future__ import annotations

import contextlib
import socket
import itertools
import threading
import types

import numpy as np
import pytest
from stub_helpers import FINAL, EngineStream, Sender, decode_hop, imported_with_stub

from disagg.triton.engine_request import EngineGone
from disagg.triton.engine_stream import EngineServer


@pytest.fixture(scope="module")
def stubbed():
    """disagg.triton's orchestrator and hop modules, imported against the stand-in stub."""
    with imported_with_stub("disagg.triton.orchestrator", "disagg.triton.hop") as modules:
        yield modules


@pytest.fixture(scope="module")
def orchestrator(stubbed):
    return stubbed[0]


@pytest.fixture(scope="module")
def hop_module(stubbed):
    return stubbed[1]


def _draining(orchestrator, hop_module, errors: list[Exception]):
    """An orchestrator whose decode hops fail with `errors`, one per try, then succeed; returns it and its tries."""
    model = object.__new__(orchestrator.TritonPythonModel)
    tries: list[dict] = []
    model.decoders = ["decode"]
    model.router = types.SimpleNamespace(pick=lambda models: hop_module.Engine("decode", "127.0.0.1:1"), done=lambda engine: None)

    @contextlib.contextmanager
    def hop(engine, inputs, request_id, request_type):
        tries.append({"id": request_id, "type": request_type, "len": int(inputs["request_output_len"][0, 0])})
        if len(tries) <= len(errors):
            raise errors[len(tries) - 1]
        yield type("Hop", (), {"results": lambda self, timeout_s, cancelled: iter([([7], None)])})()

    model._hop = hop
    return model, tries


def test_a_drain_waits_for_a_decode_server_that_is_restarting(orchestrator, hop_module):
    model, tries = _draining(orchestrator, hop_module, [hop_module.HopError(f"decode: away {i}", engine_away=True) for i in range(3)])
    model._drain("r1", {"input_ids": np.zeros((1, 3), np.int32)}, np.zeros(4, np.uint8))
    assert tries == [{"id": "r1-drain", "type": "generation_only", "len": 1}] * 4


def test_a_drain_gives_up_at_once_on_an_error_that_waiting_does_not_mend(orchestrator, hop_module):
    model, tries = _draining(orchestrator, hop_module, [hop_module.HopError("decode: context_phase_params: no handoff held under this id")])
    with pytest.raises(hop_module.HopError, match="no handoff held"):
        model._drain("r1", {}, np.zeros(4, np.uint8))
    assert len(tries) == 1


def _hop_error(hop_module, hop) -> Exception:
    with pytest.raises(hop_module.HopError) as failed:
        list(hop.results(5.0, lambda: False))
    return failed.value


@pytest.mark.parametrize("error, away", [
    ("Request for unknown model: 'decode' has no available versions", True),  # its server restarted, loading it
    (EngineGone("the engine server http://127.0.0.1:1 went away: it closed the connection"), True),
    ("context_phase_params: no handoff held under this id", False),
    ("generation_only: request_output_len 0 must be >= 1", False),
])
def test_an_engine_servers_refusal_means_it_is_coming_back_only_while_the_model_loads(hop_module, error, away):
    stream = EngineStream()
    hop = decode_hop(hop_module, stream)
    stream.on_response(None, error, True)
    failed = _hop_error(hop_module, hop)
    assert str(failed) == f"decode: {error}" and failed.engine_away is away


def test_a_broken_stream_means_the_engine_server_is_coming_back(hop_module):
    """A hop on a stream whose server goes away fails with the stream, and a hop sent on it after is refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    server = EngineServer(f"127.0.0.1:{listener.getsockname()[1]}")

    def go_away():
        connection, _ = listener.accept()
        connection.close()  # before the stream's opening is answered

    leaving = threading.Thread(target=go_away)
    leaving.start()
    try:
        stream = server.shared("decode")
        for _ in range(2):  # the hop waiting for the opening's answer, then one sent on the broken stream
            with pytest.raises(hop_module.HopError, match="stream to the engine server broke: UNAVAILABLE") as refused:
                decode_hop(hop_module, stream)
            assert refused.value.engine_away
    finally:
        leaving.join()
        listener.close()
        server.close()


class _Count:
    def __init__(self):
        self.value = 0

    def increment(self, n):
        self.value += n

    def set(self, value):
        self.value = value


def test_an_unexpected_fault_still_ends_the_request_with_an_error_and_a_log(orchestrator, monkeypatch):
    logged = []
    monkeypatch.setattr(orchestrator.pb_utils, "Logger", type("Logger", (), {"log_error": staticmethod(logged.append)}), raising=False)
    model = object.__new__(orchestrator.TritonPythonModel)
    model.instance, model.mode, model.input_names = "disagg_orchestrator_0_0", "disaggregated", {}
    model.router = types.SimpleNamespace(pool_routing="least_loaded", service_class=lambda value: None)
    model._lock, model._count, model.in_flight, model.failures = threading.Lock(), 0, _Count(), _Count()
    model._id_prefix, model._ids = "0" * 16, itertools.count()
    model.out, model.coalesce_backlog = orchestrator.ResponseThread(model.instance), 0
    model._cancel_flag = lambda request_id: orchestrator.cancel_board.NoFlag()
    released = []
    model._release = lambda request_id, inputs, reached: released.append(request_id)

    def broken(*args):
        raise KeyError("context_phase_params")

    model._disaggregated = broken
    sender = Sender()
    arrays = {"input_ids": np.array([[5, 6, 7]], np.int32), "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[4]], np.int32), "streaming": np.array([[True]])}
    for _ in model._serve(arrays, sender, 0.0):
        pass
    model.out.close()
    ((response, flags),) = sender.until_final()
    assert sender.sent.empty()
    assert flags == FINAL
    assert response.error.message() == "disagg_orchestrator_0_0: internal error: KeyError: 'context_phase_params'"
    assert model.failures.value == 1 and model.in_flight.value == 0 and len(released) == 1
    assert len(logged) == 1 and "Traceback" in logged[0] and "KeyError: 'context_phase_params'" in logged[0]
