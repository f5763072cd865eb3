"""Service classes end to end: a request's class picks the cheapest decode pool predicted to meet it, a
class no pool can meet is refused before any work with a retryable error, and a class the deployment
does not have is refused naming the input. Two decode pools on loopback (registries), one dearer."""
from __future__ import annotations

import contextlib
import queue
import secrets

import pytest
import tritonclient.grpc as grpcclient
import yaml

from disagg.engine.sampling import NO_END_ID
from disagg.render import render_repository
from disagg.spec import parse_spec
from tests.replica_helpers import Served
from tools.stream_client import StreamError, build_inputs, stream

pytestmark = pytest.mark.e2e
CLASSES = {"interactive": {"tpot_ms": 10_000}, "realtime": {"tpot_ms": 0.001}, "batch": {}}


@pytest.fixture
def deployment(cpu_tiny_project, tmp_path):
    """A front whose orchestrator has CLASSES and two decode pools, `cheap` (cost 1) and `dear` (cost 5)."""
    project = cpu_tiny_project
    raw = yaml.safe_load((project / "configs" / "cpu-tiny.yaml").read_text())
    raw["orchestrator"].update(service_classes=CLASSES, default_service_class="batch")
    with contextlib.chdir(project):  # the spec's paths are the project's
        render_repository(parse_spec(raw), "model_repository_sla")  # beside model_repository: same relative paths
    key = secrets.token_hex(16)
    started: list[Served] = []

    def serve(name: str, repository: str, *flags: str, env: dict[str, str] | None = None) -> Served:
        board = tmp_path / f"board-{name}"
        board.mkdir()
        served = Served(name, project / repository, {"DISAGG_INTERNAL_KEY": key, "DISAGG_LOAD_BOARD": str(board), **(env or {})}, *flags)
        started.append(served)
        return served

    registry = {name: tmp_path / f"registry-{name}" for name in ("prefill", "cheap", "dear")}
    prefill = serve("prefill", "model_repository", "--load-model=prefill", f"--announce={registry['prefill']}")
    cheap = serve("cheap", "model_repository", "--load-model=decode", f"--announce={registry['cheap']}")
    dear = serve("dear", "model_repository", "--load-model=decode", f"--announce={registry['dear']}")
    urls = f"prefill=registry:{registry['prefill']},decode=registry:{registry['cheap']};cost=1|registry:{registry['dear']};cost=5"
    models = [f"--load-model={m}" for m in ("preprocessing", "disagg_orchestrator", "postprocessing", "ensemble")]
    front = serve("front", "model_repository_sla", *models, env={"DISAGG_ENGINE_URLS": urls})
    for served in started:
        served.ready()
    yield front, prefill, cheap, dear, registry
    for served in reversed(started):
        served.stop()


def _ask(front: Served, i: int, **inputs) -> str:
    return stream(front.url, "ensemble", f"class request {i}", 16, end_id=NO_END_ID, timeout_s=60, **inputs).text


def _error_with_parameter(front: Served, service_class: str) -> str:
    """The error a request naming its class in a request parameter gets (none: '')."""
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(front.url)
    client.start_stream(callback=lambda result, error: answers.put(error))
    try:
        client.async_stream_infer("ensemble", build_inputs("class request 2", 16), parameters={"service_class": service_class},
                                  enable_empty_final_response=True)
        error = answers.get(timeout=60)
        return error.message() if error is not None else ""
    finally:
        client.stop_stream()
        client.close()


def test_classes_pick_pools_by_cost_and_target_and_refuse_what_no_pool_meets(deployment):
    front, prefill, cheap, dear, registry = deployment
    expected = _ask(front, 0)  # the default class, batch
    assert expected
    for i in range(6):  # batch: the least loaded decode pool, whatever it costs
        assert _ask(front, 0) == expected
    batch_split = (cheap.inferences("decode"), dear.inferences("decode"))
    assert sum(batch_split) == 7 and min(batch_split) >= 1, batch_split

    for i in range(5):  # interactive: both pools meet its target, so the cheaper one gets every request
        assert _ask(front, 0, service_class="interactive") == expected
    assert (cheap.inferences("decode") - batch_split[0], dear.inferences("decode") - batch_split[1]) == (5, 0)

    # No pool is predicted to meet realtime's target: refused before prefill does any work.
    prefill_before = prefill.inferences("prefill")
    with pytest.raises(StreamError, match=r"service class 'realtime': no decode pool is predicted to meet its time per output "
                                          r"token of 0\.001 ms now \(best: \d+ ms on registry:.*\): retry shortly") as refused:
        _ask(front, 1, service_class="realtime")
    print(refused.value)
    assert prefill.inferences("prefill") == prefill_before

    with pytest.raises(StreamError, match=r"service_class: 'gold' is not a service class of this deployment \(interactive, realtime, batch\)"):
        _ask(front, 1, service_class="gold")
    # The class as a request parameter: the ensemble passes it on to the orchestrator.
    assert "service class 'realtime': no decode pool is predicted" in _error_with_parameter(front, "realtime")
    assert _ask(front, 0, service_class="batch") == expected  # and it serves on
