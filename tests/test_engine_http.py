"""Engine hops over Triton's HTTP `generate_stream` (disagg.triton.engine_http), on a real tritonserver, against
the same hops over gRPC (disagg.triton.engine_stream): the same tokens, the handoff's params carried as JSON,
refusals, a `stop` by the id of a request in flight, and a server that went away."""
from __future__ import annotations

import queue
import threading
import time

import numpy as np
import pytest

from disagg.engine.no_compute import skipped_compute
from disagg.engine.sampling import NO_END_ID
from disagg.triton import credential
from disagg.triton.engine_request import EngineGone, EngineRequest
from disagg.triton.transport import connect

pytestmark = pytest.mark.e2e

PROMPT = [5, 77, 300, 12, 9, 41]


def _inputs(tokens: int, **extra) -> dict[str, np.ndarray]:
    return {"input_ids": np.array([PROMPT], np.int32), "input_lengths": np.array([[len(PROMPT)]], np.int32),
            "request_output_len": np.array([[tokens]], np.int32), "end_id": np.array([[NO_END_ID]], np.int32),
            "streaming": np.array([[True]]), **extra}


class Answer:
    """A request's responses as they come: tokens, params, the error, whether it ended."""

    def __init__(self):
        self.tokens: list[int] = []
        self.params: np.ndarray | None = None
        self.error: str | None = None
        self.ended = threading.Event()

    def __call__(self, result, error, final) -> None:
        if error is not None:
            self.error = error
        else:
            ids, params = result.as_numpy("output_ids"), result.as_numpy("context_phase_params")
            self.tokens += [] if ids is None else ids.reshape(-1).tolist()
            self.params = params if params is not None else self.params
        if final:
            self.ended.set()

    def streaming(self, tokens: int, timeout_s: float = 10.0) -> Answer:
        """Waits until `tokens` have come (the request is then running)."""
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < tokens and time.monotonic() < deadline:
            time.sleep(0.01)
        return self

    def wait(self, timeout_s: float = 30.0) -> Answer:
        assert self.ended.wait(timeout_s), "no final response"
        return self


def _call(server, model: str, request_id: str, key: str, inputs: dict[str, np.ndarray], request_type: str) -> Answer:
    answer = Answer()
    server.shared(model).send(EngineRequest(model, request_id, inputs, {"request_type": request_type, credential.PARAMETER: key}),
                              answer)
    return answer


@pytest.fixture(scope="module")
def served(cpu_tiny_project, start_triton):
    server = start_triton(cpu_tiny_project / "model_repository", "--model-control-mode=explicit",
                          "--load-model=aggregated_engine", "--load-model=prefill", "--load-model=decode")
    yield server
    server.stop()


def test_http_hops_give_the_tokens_grpc_hops_give_and_hand_off_the_kv(served):
    http, grpc = connect(f"http://{served.http_url}"), connect(served.grpc_url)
    try:
        key = served.internal_key
        whole = {name: _call(s, "aggregated_engine", f"w-{name}", key, _inputs(12), "context_and_generation").wait()
                 for name, s in (("http", http), ("grpc", grpc))}
        assert whole["http"].error is None and whole["grpc"].error is None
        assert len(whole["http"].tokens) == 12 and whole["http"].tokens == whole["grpc"].tokens
        context = _call(http, "prefill", "split", key, _inputs(12), "context_only").wait()
        assert context.error is None and context.tokens == whole["grpc"].tokens[:1] and context.params.size > 0
        handed = _inputs(12, context_phase_params=context.params.reshape(1, -1))
        generation = _call(http, "decode", "split", key, handed, "generation_only").wait()
        assert generation.error is None and generation.tokens == whole["grpc"].tokens  # the first token again, then the rest
        assert http.in_flight() == 0
    finally:
        http.close()
        grpc.close()


def test_refusals_leave_other_requests_streaming_and_no_connection_open(served):
    http = connect(f"http://{served.http_url}")
    try:
        streaming = [_call(http, "aggregated_engine", f"s{i}", served.internal_key, _inputs(48), "context_and_generation")
                     for i in range(4)]
        refused = [_call(http, "no_such_model", f"r{i}", served.internal_key, _inputs(4), "context_and_generation").wait()
                   for i in range(20)]
        assert {a.error for a in refused} == {"Request for unknown model: 'no_such_model' is not found"}
        wrong = _call(http, "aggregated_engine", "bad", served.internal_key, _inputs(4, request_output_len=np.array([[0]], np.int32)),
                      "context_and_generation").wait()
        assert wrong.error and "request_output_len" in wrong.error, wrong.error
        for answer in streaming:
            assert answer.wait().error is None and len(answer.tokens) == 48
        deadline = time.monotonic() + 5
        while http.connections() and time.monotonic() < deadline:  # the reader closes each after its answer
            time.sleep(0.01)
        assert http.connections() == 0
    finally:
        http.close()


KEY = "b" * 32  # the internal key of `_stepping`'s server


def _stepping(project, start_triton, board):
    """A second server beside `served`, with a board and key of its own, its engines taking 20 ms a step."""
    with skipped_compute(20.0):
        return start_triton(project / "model_repository", "--model-control-mode=explicit", "--load-model=aggregated_engine",
                            env={"DISAGG_LOAD_BOARD": str(board), "DISAGG_INTERNAL_KEY": KEY})


def test_a_stop_names_a_request_in_flight_by_its_id(cpu_tiny_project, start_triton, tmp_path):
    server = _stepping(cpu_tiny_project, start_triton, tmp_path)
    http = connect(f"http://{server.http_url}")
    try:
        running = _call(http, "aggregated_engine", "long", KEY, _inputs(300), "context_and_generation").streaming(3)
        stop = {"input_lengths": np.array([[0]], np.int32), "request_output_len": np.array([[1]], np.int32),
                "stop": np.array([[True]])}
        stopped = Answer()
        alone = http.open()
        alone.send(EngineRequest("aggregated_engine", "long", stop, {"request_type": "context_and_generation",
                                                                     credential.PARAMETER: KEY}), stopped)
        alone.close()
        assert stopped.wait().error is None
        assert running.wait().error is None and 3 <= len(running.tokens) < 100, len(running.tokens)
    finally:
        http.close()
        server.stop()


def test_a_server_that_went_away_fails_its_requests_as_gone(cpu_tiny_project, start_triton, tmp_path):
    server = _stepping(cpu_tiny_project, start_triton, tmp_path)
    http = connect(f"http://{server.http_url}")
    try:
        running = _call(http, "aggregated_engine", "cut", KEY, _inputs(300), "context_and_generation").streaming(1)
        server.process.kill()
        assert isinstance(running.wait().error, EngineGone), running.error
        server.stop()
        with pytest.raises(ConnectionError, match="went away"):
            _call(http, "aggregated_engine", "late", KEY, _inputs(2), "context_and_generation")
        assert http.in_flight() == 0
    finally:
        http.close()
        server.stop()


def test_a_server_stops_at_once_with_the_client_still_open(cpu_tiny_project, start_triton, tmp_path):
    """Triton's shutdown first waits for its HTTP connections to close, before it unloads any model: a
    connection kept open for the next request held the server for its whole exit timeout. Each request's
    connection closes with its answer."""
    server = _stepping(cpu_tiny_project, start_triton, tmp_path)
    http = connect(f"http://{server.http_url}")
    try:
        for i in range(3):
            assert _call(http, "aggregated_engine", f"one{i}", KEY, _inputs(2), "context_and_generation").wait().tokens
        server.stop()
        log = server.log_path.read_text()
        assert "HTTP service connections" not in log and "Exit timeout expired" not in log, log[-1500:]
    finally:
        http.close()
        server.stop()


def test_close_ends_requests_still_running():
    """Without a server's answer: a request whose connection is closed under it gets EngineGone, once."""
    import socket
    listener = socket.create_server(("127.0.0.1", 0))
    http = connect(f"http://127.0.0.1:{listener.getsockname()[1]}")
    answers: queue.SimpleQueue = queue.SimpleQueue()
    http.send(EngineRequest("m", "x", {"input_ids": np.array([[1]], np.int32)}, {}), lambda r, e, f: answers.put((r, e, f)))
    conn, _ = listener.accept()
    http.close()
    result, error, final = answers.get(timeout=5)
    assert result is None and final and isinstance(error, EngineGone)
    assert answers.empty()
    conn.close()
    listener.close()
