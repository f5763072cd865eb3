"""Service classes end to end: a request's class picks the cheapest decode pool predicted to meet it, a
class no pool can meet is refused before any work with a retryable error, and a class the deployment
does not have is refused naming the input. Two decode pools on loopback (registries), one dearer."""
from __future__ import annotations

import contextlib
import queue
import secrets
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import tritonclient.grpc as grpcclient
import yaml

from disagg.engine.no_compute import stand_in_env
from disagg.engine.sampling import NO_END_ID
from disagg.render import render_repository
from disagg.spec import parse_spec
from disagg.serve.openai_front import OpenAIFront
from disagg.serve.metrics import scrape
from disagg.serve.process import Served
from tools.stream_client import StreamError, build_inputs, stream

pytestmark = pytest.mark.e2e
CLASSES = {"interactive": {"ttft_ms": 10_000, "tpot_ms": 10_000}, "realtime": {"tpot_ms": 0.001}, "batch": {}}
# The engine replicas stand in for GPUs (disagg.engine.no_compute): each step takes this long off the CPU, so
# requests sent at once overlap on the decode pools on any machine and both pools are measured. Computing, a
# fast machine's cores finished each 16-token decode hop before the next arrived, and one pool took 9 of 11.
STEP_MS = 10.0


@pytest.fixture(scope="module")
def deployment(cpu_tiny_project, tmp_path_factory):
    """A front whose orchestrator has CLASSES and two decode pools, `cheap` (cost 1) and `dear` (cost 5);
    the tests run in order on it (the first counts requests from none)."""
    tmp_path = tmp_path_factory.mktemp("sla")
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
    stand_in = stand_in_env(STEP_MS)  # every engine alike: the aggregated path's tokens are then the disaggregated one's
    prefill = serve("prefill", "model_repository", "--load-model=prefill", f"--announce={registry['prefill']}", env=stand_in)
    cheap = serve("cheap", "model_repository", "--load-model=decode", "--load-model=aggregated_engine", f"--announce={registry['cheap']}",
                  env=stand_in)
    dear = serve("dear", "model_repository", "--load-model=decode", "--load-model=aggregated_engine", f"--announce={registry['dear']}",
                 env=stand_in)
    pools = f"registry:{registry['cheap']};cost=1|registry:{registry['dear']};cost=5"
    urls = f"prefill=registry:{registry['prefill']},decode={pools},aggregated_engine={pools}"
    models = [f"--load-model={m}" for m in ("preprocessing", "disagg_orchestrator", "aggregated_orchestrator", "postprocessing", "ensemble", "aggregated")]
    front = serve("front", "model_repository_sla", *models, env={"DISAGG_ENGINE_URLS": urls})
    for served in started:
        served.ready()
    yield front, prefill, cheap, dear, registry
    front.stop()  # first: nothing then calls the replicas, which stop side by side (each drains on its own)
    with ThreadPoolExecutor(len(started)) as stopping:
        list(stopping.map(Served.stop, started))


def _ask(front: Served, i: int, model: str = "ensemble", **inputs) -> str:
    return stream(front.url, model, f"class request {i}", 16, end_id=NO_END_ID, timeout_s=60, **inputs).text


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
    with ThreadPoolExecutor(10) as clients:  # batch, 10 at once: the least loaded decode pool, whatever it costs
        assert list(clients.map(lambda _: _ask(front, 0), range(10))) == [expected] * 10
    batch_split = (cheap.inferences("decode"), dear.inferences("decode"))
    assert sum(batch_split) == 11 and min(batch_split) >= 3, batch_split  # and both pools are measured

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

    # What routing saw, on the front's metrics: both refusals of realtime, and each decode pool's hops.
    def series(name: str, **labels) -> float:
        text = scrape(f"http://127.0.0.1:{front.metrics}/metrics", 2.0)
        found = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items())]
        return sum(found)

    def applied() -> bool:  # every update made so far, in whatever order its thread applies them
        return (series("disagg_service_class_refused_total", service_class="realtime") >= 2
                and series("disagg_pool_ttft_seconds_count", pool=f"registry:{registry['prefill']}") >= 17)

    deadline = time.monotonic() + 5  # the orchestrator's metrics are applied by a thread of their own
    while not applied() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert series("disagg_service_class_refused_total", service_class="realtime") == 2
    assert series("disagg_service_class_refused_total", service_class="interactive") == 0
    for pool in ("cheap", "dear"):
        assert series("disagg_pool_tpot_seconds_count", pool=f"registry:{registry[pool]}") >= 3
    assert series("disagg_pool_ttft_seconds_count", pool=f"registry:{registry['prefill']}") >= 17


def test_the_aggregated_path_routes_by_class_too(deployment):
    front, _, cheap, dear, _ = deployment
    expected = _ask(front, 0)
    with ThreadPoolExecutor(8) as clients:  # batch, 8 at once: both pools serve, and are measured
        assert list(clients.map(lambda _: _ask(front, 0, "aggregated"), range(8))) == [expected] * 8
    before = (cheap.inferences("aggregated_engine"), dear.inferences("aggregated_engine"))
    assert min(before) >= 3, before
    for _ in range(4):  # both pools meet interactive's TTFT and TPOT: the cheaper one takes every request
        assert _ask(front, 0, "aggregated", service_class="interactive") == expected  # as disaggregated, token for token
    assert (cheap.inferences("aggregated_engine") - before[0], dear.inferences("aggregated_engine") - before[1]) == (4, 0)


def test_the_openai_api_takes_a_service_class_and_answers_a_refusal_with_503(deployment, cpu_tiny_project, tmp_path):
    front = deployment[0]
    with OpenAIFront(cpu_tiny_project / "model_repository_sla", front.url, log_path=tmp_path / "openai.log") as api:
        client = openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="ensemble", prompt="class request 0", max_tokens=8, temperature=0)
        assert client.completions.create(**ask, extra_body={"service_class": "interactive"}).choices[0].text
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(**ask, extra_body={"service_class": "realtime"})
        assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
        assert "service class 'realtime': no decode pool is predicted to meet" in refused.value.body["message"]
        with pytest.raises(openai.APIStatusError) as streamed:  # streamed: refused before the response starts
            list(client.completions.create(**ask, stream=True, extra_body={"service_class": "realtime"}))
        assert streamed.value.status_code == 503 and "service class 'realtime'" in streamed.value.body["message"]
        with pytest.raises(openai.BadRequestError) as unknown:
            client.completions.create(**ask, extra_body={"service_class": "gold"})
        assert unknown.value.body["param"] == "service_class"
        assert unknown.value.body["message"] == "service_class: 'gold' is not a service class of this deployment (interactive, realtime, batch)"
