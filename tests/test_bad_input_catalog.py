"""Every request of the bad-input catalog (loadtest/bad_inputs.py) against a real server, while a good
stream runs beside them: each is refused with its error, the good stream's text is unchanged, the server
keeps serving, and no KV block is held afterwards."""
from __future__ import annotations

import threading

import pytest

from disagg.engine.sampling import NO_END_ID
from disagg.serve.metrics import by_role, scrape
from loadtest.bad_inputs import CATALOG, send
from tests.e2e_helpers import wait_kv_zero
from tools.stream_client import StreamError, stream

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    s = start_triton(cpu_tiny_project / "model_repository")
    yield s
    s.stop()


def test_the_catalog_has_30_distinct_bad_requests_over_every_path():
    assert len({b.name for b in CATALOG}) == len(CATALOG) >= 30
    assert {b.via for b in CATALOG} == {"generate", "generate_stream", "grpc", "engine"}


def test_each_bad_request_gets_its_error_and_disturbs_nothing(server):
    expected = {m: stream(server.grpc_url, m, "Call me Ishmael.", 200, end_id=NO_END_ID).text for m in ("ensemble", "aggregated")}
    beside: dict[str, str] = {}

    def good(model: str) -> None:
        beside[model] = stream(server.grpc_url, model, "Call me Ishmael.", 200, end_id=NO_END_ID, timeout_s=300).text

    threads = [threading.Thread(target=good, args=(m,)) for m in expected]
    for t in threads:
        t.start()
    failures = []
    for bad in CATALOG:
        try:
            send(bad, server.http_url, server.grpc_url, server.internal_key)
        except AssertionError as exc:
            failures.append(str(exc))
    for t in threads:
        t.join(300)
    assert failures == []
    assert beside == expected  # requests beside the bad ones got exactly their text
    assert wait_kv_zero(server, timeout_s=10.0) == {"prefill": 0, "decode": 0, "aggregated": 0}
    assert by_role(scrape(server.metrics_url))["disagg_kv_handoff_held"]["prefill"] == 0
    assert stream(server.grpc_url, "ensemble", "Call me Ishmael.", 200, end_id=NO_END_ID).text == expected["ensemble"]


def test_a_refused_request_leaves_the_ensemble_free_to_unload(server, cpu_tiny_project, start_triton):
    """The project's clients do not cancel a stream whose request was refused (an error is its final
    response): Triton 2.51 would keep the ensemble loaded, and the next stop would wait out the whole exit
    timeout for it (README, Known problems). On a fresh server: the module's is stopped first, since a second
    server of one repository on one load board is refused."""
    server.stop()
    server = start_triton(cpu_tiny_project / "model_repository")
    refused_by_triton = next(b for b in CATALOG if b.name == "max_tokens of the wrong dtype")
    send(refused_by_triton, server.http_url, server.grpc_url, server.internal_key)
    with pytest.raises(StreamError, match="max_tokens: 100000 is over the limit"):
        stream(server.grpc_url, "ensemble", "Call me Ishmael.", 100_000)
    server.stop()
    log = server.log_path.read_text()
    assert "successfully unloaded 'ensemble'" in log, log[-2000:]  # else it was live until the server exited
