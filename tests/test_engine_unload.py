"""An engine model of several instances publishes the tensorrtllm backend's gauges once, summed over its
instances, and its server stops cleanly: when every instance published them, a stop crashed tritonserver as
the model unloaded (`Signal (11)`, `malloc_consolidate(): unaligned fastbin chunk detected`; disagg.triton.
metrics.BackendMetrics) in 2 of 11 `loadtest splits` runs of aggregated x3 and about half the calibrations
of aggregated x2 (real tritonserver)."""
from __future__ import annotations

import contextlib
import re
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import yaml

from disagg.cli import main
from disagg.serve.leftovers import stubs_of
from disagg.serve.metrics import scrape
from disagg.spec import load_spec
from loadtest.compare import deployment_models
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

INSTANCES = 3
STOPS = 3  # the crash came at some stops, not all


@pytest.fixture(scope="module")
def repository(new_project):
    project = new_project("three-instances")
    spec_path = project / "configs" / "cpu-tiny.yaml"
    raw = yaml.safe_load(spec_path.read_text())
    raw["roles"]["aggregated"]["instances"] = INSTANCES
    spec_path.write_text(yaml.safe_dump(raw))
    with contextlib.chdir(project):
        assert main(["--config", "configs/cpu-tiny.yaml"]) == 0
    return project / "model_repository"


def _gauge(text: str, request_type: str) -> list[float]:
    pattern = rf'^nv_trt_llm_request_metrics\{{[^}}]*model="aggregated_engine"[^}}]*request_type="{request_type}"[^}}]*\}} (\S+)$'
    return [float(v) for v in re.findall(pattern, text, re.MULTILINE)]


def test_a_model_of_three_instances_publishes_the_backend_gauges_once_and_stops_cleanly(repository, start_triton):
    with contextlib.chdir(repository.parent):
        spec = load_spec(Path("configs/cpu-tiny.yaml"))
    max_batch = spec.roles["aggregated"].max_batch_size
    _, models = deployment_models(spec, "aggregated")
    only_aggregated = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]  # as the crashing runs served it
    for _ in range(STOPS):
        server = start_triton(repository, *only_aggregated)
        assert stream(server.grpc_url, "aggregated", "Call me Ishmael.", 8).text
        deadline = time.monotonic() + 5
        while (found := _gauge(scrape(server.metrics_url), "max")) != [INSTANCES * max_batch] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert found == [INSTANCES * max_batch]  # one series, every instance's batch slots
        server.stop()
        log = server.log_path.read_text()
        assert "successfully unloaded 'aggregated_engine'" in log, log[-3000:]
        assert not re.search(r"Signal \((?!15\))", log) and "malloc" not in log, log[-3000:]


def test_an_engine_model_unloads_while_the_orchestrator_s_stream_to_it_stays_open(repository, start_triton):
    """The orchestrator keeps one gRPC stream per engine model open; Triton holds a stream's first request,
    and so its model, until the stream ends (disagg.triton.engine_stream). An engine model unloaded through the
    repository API (as the watchdog reloads one) must still let its instances go."""
    with contextlib.chdir(repository.parent):
        _, models = deployment_models(load_spec(Path("configs/cpu-tiny.yaml")), "aggregated")
    server = start_triton(repository, "--model-control-mode=explicit", *(f"--load-model={m}" for m in models))
    assert stream(server.grpc_url, "aggregated", "Call me Ishmael.", 8).text  # opens the orchestrator's stream
    assert len(stubs_of(repository / "aggregated_engine")) == INSTANCES
    grpcclient.InferenceServerClient(server.grpc_url).unload_model("aggregated_engine")
    deadline = time.monotonic() + 5
    while True:  # Triton logs the unload after the last stub has gone, so wait for both
        left = stubs_of(repository / "aggregated_engine")
        log = server.log_path.read_text()
        if (not left and "successfully unloaded 'aggregated_engine'" in log) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert left == [], "the unloaded engine's stubs still run while the orchestrator's stream is open"
    assert "successfully unloaded 'aggregated_engine'" in log, log[-3000:]
    assert server.stop() == 0
