"""Merging several servers' Prometheus expositions (the API's /metrics under disagg-serve), and reading a
histogram back."""
from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.serve.metrics import by_role, histograms, merge

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


HISTOGRAM = """# HELP disagg_first_hop_seconds Request arrival -> its first engine request sent
# TYPE disagg_first_hop_seconds histogram
disagg_first_hop_seconds_bucket{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0",le="0.0002"} {a}
disagg_first_hop_seconds_bucket{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0",le="0.0004"} {b}
disagg_first_hop_seconds_bucket{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0",le="0.001"} {c}
disagg_first_hop_seconds_bucket{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0",le="+Inf"} {d}
disagg_first_hop_seconds_sum{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0"} {s}
disagg_first_hop_seconds_count{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0"} {d}
disagg_ttft_seconds_count{role="orchestrator-disaggregated",instance="tensorrt_llm_bls_0_0"} 9
"""


def _exposition(a, b, c, d, s):
    return HISTOGRAM.replace("{a}", str(a)).replace("{b}", str(b)).replace("{c}", str(c)).replace("{d}", str(d)).replace("{s}", str(s))


def test_a_histogram_read_back_gives_what_was_observed_between_two_readings_and_its_quantiles():
    before = histograms(_exposition(1, 1, 2, 2, 0.0005), "disagg_first_hop_seconds")
    after = histograms(_exposition(1, 3, 6, 7, 0.0045), "disagg_first_hop_seconds")
    assert set(after) == {"tensorrt_llm_bls_0_0"}
    between = after["tensorrt_llm_bls_0_0"].since(before["tensorrt_llm_bls_0_0"])
    assert between.buckets == ((0.0002, 0), (0.0004, 2), (0.001, 4), (math.inf, 5)) and between.count == 5
    assert between.sum == pytest.approx(0.004)
    # as Prometheus's histogram_quantile: linear within the bucket holding the rank
    assert between.quantile(0.2) == pytest.approx(0.0002 + 0.0002 * 1 / 2)
    assert between.quantile(0.5) == pytest.approx(0.0004 + 0.0006 * 0.5 / 2)
    assert between.quantile(0.99) == 0.001  # in +Inf: the highest finite bound
    assert between.plus(between).count == 10 and between.plus(between).quantile(0.5) == between.quantile(0.5)
    assert math.isnan(before["tensorrt_llm_bls_0_0"].since(before["tensorrt_llm_bls_0_0"]).quantile(0.5))
