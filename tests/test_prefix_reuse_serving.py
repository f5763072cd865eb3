"""Prefix reuse served: cpu-tiny with `enable_kv_cache_reuse: true` on every role, through both ensembles."""
from __future__ import annotations

import contextlib
import time

import pytest
import yaml

from disagg.cli import main
from disagg.serve.metrics import by_role, scrape
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

SYSTEM = "You are a terse assistant. Answer in one line. Examples: the sky is blue; water is wet; fire is hot. "


def test_shared_prefixes_are_reused_and_answers_stay_those_of_aggregated(new_project, start_triton):
    project = new_project("prefix-reuse")
    config = project / "configs" / "cpu-tiny.yaml"
    raw = yaml.safe_load(config.read_text())
    for role in raw["roles"].values():
        role["enable_kv_cache_reuse"] = True
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    with contextlib.chdir(project):
        assert main(["--config", "configs/cpu-tiny.yaml"]) == 0
    server = start_triton(project / "model_repository")
    try:
        questions = ["What is the sky?", "What is water?", "What is fire?"]
        first = {q: stream(server.grpc_url, "aggregated", SYSTEM + q, 24).text for q in questions}
        for q in questions:  # the ensemble's prefill finds the system prompt cached after the first question
            assert stream(server.grpc_url, "ensemble", SYSTEM + q, 24).text == first[q]
            assert stream(server.grpc_url, "aggregated", SYSTEM + q, 24).text == first[q]  # now from its own cache
        deadline = time.monotonic() + 5
        while True:  # the engines refresh their gauges every 0.1 s
            metrics = by_role(scrape(server.metrics_url))
            if not any(metrics["disagg_kv_blocks_in_use"].values()) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert metrics["disagg_kv_reused_blocks"]["prefill"] > 0 and metrics["disagg_kv_reused_blocks"]["aggregated"] > 0
        assert metrics["disagg_kv_blocks_cached"]["aggregated"] > 0
        assert metrics["disagg_kv_blocks_in_use"] == {"prefill": 0, "decode": 0, "aggregated": 0}
    finally:
        server.stop()
