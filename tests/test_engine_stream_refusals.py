"""On a real tritonserver: requests the server refuses (a model it has not loaded, as while the watchdog
reloads one) go on a stream of their own, beside another model's requests streaming tokens on the same
server. Triton 2.51 writes such a refusal without waiting for a decoupled response's write in flight on its
stream, and two writes at once abort it (`proto_buffer_writer.h:65] ASSERTION FAILED`; README, Known
problems): with both models on one stream this test's server aborted within seconds."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from disagg.engine.no_compute import skipped_compute
from disagg.engine.sampling import NO_END_ID
from disagg.triton import credential
from disagg.triton.engine_request import EngineRequest
from disagg.triton.engine_stream import EngineServer

pytestmark = pytest.mark.e2e

STREAMS = 16  # aggregated_engine requests kept in flight
TOKENS = 48
SECONDS = 4.0
REFUSAL_EVERY_S = 0.005


def _request(model: str, request_id: str, key: str):
    inputs = {"input_ids": np.array([[5, 77, 300, 12]], np.int32), "input_lengths": np.array([[4]], np.int32),
              "request_output_len": np.array([[TOKENS]], np.int32), "end_id": np.array([[NO_END_ID]], np.int32),
              "streaming": np.array([[True]])}
    return EngineRequest(model, request_id, inputs, {"request_type": "context_and_generation", credential.PARAMETER: key},
                         ("output_ids",))


def test_refusals_and_another_models_tokens_on_one_server_leave_it_running(cpu_tiny_project, start_triton):
    with skipped_compute(5.0):  # a step every 5 ms: tokens stream while the refusals come
        server = start_triton(cpu_tiny_project / "model_repository", "--model-control-mode=explicit",
                              "--load-model=aggregated_engine")
    engines = EngineServer(server.grpc_url)
    lock = threading.Lock()
    tokens: dict[str, int] = {}
    finished: list[tuple[str, str | None]] = []
    refusals: list[str] = []
    sent = iter(range(10**6))
    deadline = time.monotonic() + SECONDS

    def send() -> None:
        request_id = f"a{next(sent)}"
        tokens[request_id] = 0
        engines.shared("aggregated_engine").send(_request("aggregated_engine", request_id, server.internal_key),
                                                 lambda result, error, final, rid=request_id: on_token(rid, result, error, final))

    def on_token(request_id: str, result, error: str | None, final: bool) -> None:
        with lock:
            if result is not None and result.as_numpy("output_ids") is not None:
                tokens[request_id] += result.as_numpy("output_ids").size
            if final:
                finished.append((request_id, error))
                if time.monotonic() < deadline:
                    send()

    def on_refusal(result, error: str | None, final: bool) -> None:
        with lock:
            refusals.append(error)

    try:
        with lock:
            for _ in range(STREAMS):
                send()
        n = 0
        while time.monotonic() < deadline:
            n += 1
            engines.shared("prefill").send(_request("prefill", f"r{n}", server.internal_key), on_refusal)
            time.sleep(REFUSAL_EVERY_S)
        end = time.monotonic() + 15
        while time.monotonic() < end and (len(finished) < len(tokens) or len(refusals) < n):
            time.sleep(0.05)
        log = server.log_path.read_text()
        assert "Signal (" not in log and "ASSERTION FAILED" not in log, log[-2000:]
        assert n > 300 and len(refusals) == n, (n, len(refusals))
        assert all("Request for unknown model: 'prefill'" in error for error in refusals), refusals[:3]
        assert len(finished) == len(tokens) > 2 * STREAMS, (len(finished), len(tokens))
        assert [error for _, error in finished] == [None] * len(finished)
        assert set(tokens.values()) == {TOKENS}  # every answer whole
    finally:
        engines.close()
        server.stop()
