"""Merging several servers' Prometheus expositions (the API's /metrics under disagg-serve)."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from disagg.serve.metrics import by_role, merge

MAIN = """# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="ensemble",version="1"} 7
# HELP disagg_orchestrator_in_flight Requests the orchestrator is serving
# TYPE disagg_orchestrator_in_flight gauge
disagg_orchestrator_in_flight{role="orchestrator-disaggregated",instance="o0"} 2
"""
DECODE = """# HELP nv_inference_count Number of inferences performed
# TYPE nv_inference_count counter
nv_inference_count{model="decode",version="1"} 5
# HELP disagg_kv_blocks_in_use KV blocks held
# TYPE disagg_kv_blocks_in_use gauge
disagg_kv_blocks_in_use{role="decode",instance="decode_0_0"} 12
# HELP up_unlabelled An unlabelled sample
# TYPE up_unlabelled gauge
up_unlabelled 1
"""


def test_each_family_once_and_every_sample_labelled_with_its_server():
    text = merge({"main": MAIN, "decode": DECODE})
    assert text.count("# TYPE nv_inference_count counter") == 1 and text.count("# HELP nv_inference_count") == 1
    families = {f.name: f for f in text_string_to_metric_families(text)}
    counts = {s.labels["server"]: (s.labels["model"], s.value) for s in families["nv_inference_count"].samples}
    assert counts == {"main": ("ensemble", 7.0), "decode": ("decode", 5.0)}
    assert [s.labels for s in families["up_unlabelled"].samples] == [{"server": "decode"}]
    assert by_role(text)["disagg_kv_blocks_in_use"] == {"decode": 12.0}
    assert by_role(text)["disagg_orchestrator_in_flight"] == {"orchestrator-disaggregated": 2.0}


def test_no_servers_is_an_empty_exposition():
    assert list(text_string_to_metric_families(merge({}))) == []
