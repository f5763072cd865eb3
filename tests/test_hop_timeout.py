"""A hop that does not answer in time: the client gets the first token at once and then an error naming
the hop when its timeout runs out; the handoff no decode took is reclaimed when its lease runs out (a
`stop` cannot free a context-only request that has answered, as with the tensorrtllm backend), and the
server keeps serving (real tritonserver; `decode` is replaced by a model that answers only long after the
orchestrator's timeout)."""
from __future__ import annotations

import contextlib
import queue
import time

import pytest
import yaml

from disagg.cli import main
from disagg.serve.metrics import by_role, scrape
import tritonclient.grpc as grpcclient

from tools.stream_client import StreamError, build_inputs, stream

pytestmark = pytest.mark.e2e

DECODE_TIMEOUT_S = 1.0
LEASE_S = 2.0

SILENT_MODEL = '''
import threading

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """A decode engine that hangs: it answers each request only 3 s late, with an error (so the server
    still shuts down cleanly, with nothing in flight)."""

    def execute(self, requests):
        for request in requests:
            threading.Timer(3.0, self._late, args=(request.get_response_sender(),)).start()
        return None

    @staticmethod
    def _late(sender):
        error = pb_utils.TritonError("answered too late")
        sender.send(pb_utils.InferenceResponse(error=error), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''


@pytest.fixture(scope="module")
def server(new_project, start_triton):
    project = new_project("hop-timeout")
    spec_path = project / "configs" / "cpu-tiny.yaml"
    raw = yaml.safe_load(spec_path.read_text())
    raw["orchestrator"]["decode_timeout_s"] = DECODE_TIMEOUT_S
    raw["kv_transfer"]["lease_seconds"] = LEASE_S
    spec_path.write_text(yaml.safe_dump(raw))
    with contextlib.chdir(project):
        assert main(["--config", "configs/cpu-tiny.yaml"]) == 0
    (project / "model_repository" / "decode" / "1" / "model.py").write_text(SILENT_MODEL)
    s = start_triton(project / "model_repository")
    yield s
    s.stop()


def _prefill_freed(server) -> dict:
    """Metrics once prefill's held handoff is reclaimed (its lease runs out), or after the deadline."""
    deadline = time.monotonic() + LEASE_S + 5
    while (metrics := by_role(scrape(server.metrics_url)))["disagg_kv_blocks_in_use"]["prefill"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics


def test_a_silent_decode_times_out_with_the_hop_named_and_prefill_is_reclaimed(server):
    failed = by_role(scrape(server.metrics_url))["disagg_orchestrator_failures_total"]["orchestrator-disaggregated"]
    start = time.monotonic()
    with pytest.raises(StreamError, match=rf"decode: no response within {DECODE_TIMEOUT_S:g} s$") as err:
        stream(server.grpc_url, "ensemble", "Call me Ishmael.", 8, timeout_s=30)
    waited = time.monotonic() - start
    assert DECODE_TIMEOUT_S <= waited < DECODE_TIMEOUT_S + 1.0, waited  # the error comes before the cleanup
    assert str(err.value).startswith("in ensemble 'ensemble', ")
    metrics = _prefill_freed(server)
    assert metrics["disagg_kv_blocks_in_use"] == {"prefill": 0, "aggregated": 0}
    assert metrics["disagg_kv_handoff_reclaimed_total"]["prefill"] >= 1  # by the lease: no decode took it
    assert metrics["disagg_orchestrator_failures_total"]["orchestrator-disaggregated"] == failed + 1
    assert stream(server.grpc_url, "aggregated", "Call me Ishmael.", 8).text  # the rest still serves
    log = server.log_path.read_text()
    assert f"failed: decode: no response within {DECODE_TIMEOUT_S:g} s" in log  # the operator sees it too


def test_the_first_token_reaches_the_client_before_decode_answers(server):
    expected_first = stream(server.grpc_url, "aggregated", "Call me Ishmael.", 8).chunks[0]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: responses.put((time.monotonic(), result, error)))
        sent = time.monotonic()
        client.async_stream_infer("ensemble", build_inputs("Call me Ishmael.", 8), enable_empty_final_response=True)
        arrived, first, error = responses.get(timeout=30)
        assert error is None and first.as_numpy("text_output").reshape(-1)[0].decode() == expected_first
        assert arrived - sent < DECODE_TIMEOUT_S  # decode has not answered (it never does in time)
        _, _, error = responses.get(timeout=30)
        assert error is not None and error.message().endswith(f"decode: no response within {DECODE_TIMEOUT_S:g} s")
        client.stop_stream()
    finally:
        client.close()
    assert _prefill_freed(server)["disagg_kv_blocks_in_use"]["prefill"] == 0
