"""Decode served by another tritonserver (a separate pool, here on loopback): the orchestrator reaches it
at the URL its `engine_urls` parameter names, a gRPC `host:port` (prefill, on the front's server, over HTTP),
and the text is still exactly the aggregated text."""
from __future__ import annotations

import contextlib

import pytest

from disagg.cli import main
from disagg.serve.metrics import by_role, scrape
from disagg.triton import credential
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

PROMPTS = ["Call me Ishmael.", "It was the best of times", "Unicode: café naïve 東京 ✓"]
FRONT = ["preprocessing", "postprocessing", "prefill", "disagg_orchestrator", "ensemble",
         "aggregated_engine", "aggregated_orchestrator", "aggregated"]  # fmt: skip


def test_decode_on_another_server(new_project, start_triton, monkeypatch):
    """Both servers get the deployment's internal credential from the environment, as separate nodes would."""
    monkeypatch.setenv(credential.INTERNAL_KEY_ENV, "a-secret-both-pools-share")
    project = new_project("two-servers")
    with contextlib.chdir(project):
        assert main(["--config", "configs/cpu-tiny.yaml"]) == 0
    repo = project / "model_repository"
    decode_pool = start_triton(repo, "--model-control-mode=explicit", "--load-model=decode")
    config = repo / "disagg_orchestrator" / "config.pbtxt"
    rendered = 'key: "engine_urls" value: { string_value: "" }'
    assert rendered in config.read_text()
    config.write_text(config.read_text().replace(rendered, rendered.replace('""', f'"decode={decode_pool.grpc_url}"')))
    front = start_triton(repo, "--model-control-mode=explicit", *(f"--load-model={m}" for m in FRONT))
    try:
        for prompt in PROMPTS:
            expected = stream(front.grpc_url, "aggregated", prompt, 24).text
            assert stream(front.grpc_url, "ensemble", prompt, 24).text == expected
        decode = by_role(scrape(decode_pool.metrics_url))
        assert decode["disagg_kv_handoff_count_total"] == {"decode": len(PROMPTS)}  # every decode ran there
        assert "decode" not in by_role(scrape(front.metrics_url))["disagg_kv_blocks_in_use"]
    finally:
        front.stop()
        decode_pool.stop()
