"""Prefix reuse served: cpu-tiny with `enable_kv_cache_reuse: true` on every role, through both ensembles."""
from __future__ import annotations

import contextlib
import time
from pathlib import Path

import pytest
import yaml

from disagg.bench.prefix import routing_hit_rates
from disagg.cli import main
from disagg.serve.metrics import by_role, scrape
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

SYSTEM = "You are a terse assistant. Answer in one line. Examples: the sky is blue; water is wet; fire is hot. "


def built_with_reuse(new_project, name: str, prefill: dict | None = None, orchestrator: dict | None = None) -> Path:
    """A built copy of cpu-tiny with `enable_kv_cache_reuse` on every role (and `prefill`/`orchestrator`
    changes); its model repository."""
    project = new_project(name)
    config = project / "configs" / "cpu-tiny.yaml"
    raw = yaml.safe_load(config.read_text())
    for role in raw["roles"].values():
        role["enable_kv_cache_reuse"] = True
    raw["roles"]["prefill"].update(prefill or {})
    raw["orchestrator"].update(orchestrator or {})
    config.write_text(yaml.safe_dump(raw, sort_keys=False))
    with contextlib.chdir(project):
        assert main(["--config", "configs/cpu-tiny.yaml"]) == 0
    return project / "model_repository"


def test_shared_prefixes_are_reused_and_answers_stay_those_of_aggregated(new_project, start_triton):
    repo = built_with_reuse(new_project, "prefix-reuse")
    server = start_triton(repo)
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
        tpb = 16
        assert metrics["disagg_kv_reused_tokens"]["prefill"] == metrics["disagg_kv_reused_blocks"]["prefill"] * tpb
        assert 0 < metrics["disagg_kv_prefix_hit_rate"]["prefill"] == \
            metrics["disagg_kv_reused_blocks"]["prefill"] / metrics["disagg_kv_prompt_blocks"]["prefill"]
        assert metrics["disagg_kv_blocks_in_use"] == {"prefill": 0, "decode": 0, "aggregated": 0}
    finally:
        server.stop()


def test_cache_aware_routing_sends_repeat_prefixes_where_they_are_cached(new_project):
    """Two prefill instances, four system prompts asked four questions each, interleaved: cache-aware
    routing finds more of the prompts cached than random routing."""
    repo = built_with_reuse(new_project, "prefix-routing", prefill={"instances": 2})
    rates = routing_hit_rates(repo)
    (aware, looked_up), (at_random, looked_up_random) = rates["cache_aware"], rates["random"]
    assert looked_up == looked_up_random > 0
    assert aware / looked_up > at_random / looked_up_random
    # every repeat found its system prompt: 12 repeats, each system prompt's whole blocks (>= 2 of 16 tokens)
    assert aware >= 12 * 2


def test_the_node_store_serves_a_prefix_one_prefill_instance_computed_to_the_other(new_project, start_triton):
    # random routing: both instances see the system prompt
    repo = built_with_reuse(new_project, "prefix-store", prefill={"instances": 2, "kv_store_mb": 16, "kv_store_disk_mb": 16},
                            orchestrator={"prefill_routing": "random"})
    server = start_triton(repo)
    key = server.board_key
    try:
        for q in range(6):
            prompt = SYSTEM + f"Question {q}?"
            assert stream(server.grpc_url, "ensemble", prompt, 16).text == stream(server.grpc_url, "aggregated", prompt, 16).text
        time.sleep(1.2)  # the store's size is scanned once a second
        metrics = by_role(scrape(server.metrics_url))
        # the instance that did not compute the system prompt first imported it from the store
        assert metrics["disagg_kv_store_hits"]["prefill"] > 0
        assert 0 < metrics["disagg_kv_store_bytes"]["prefill"] <= 2 * 16 << 20  # both instances report the one store
        assert list(Path("/dev/shm").glob(f"disagg-kvstore-{key}-*"))
    finally:
        server.stop()
    assert not list(Path("/dev/shm").glob(f"disagg-kvstore-{key}-*"))  # swept with the deployment
    # the disk tier below it outlives the deployment, in a directory named by the weights
    [weights] = (repo.parent / "build" / "kv-store").iterdir()
    assert len(weights.name) == 16 and weights.is_dir()
