"""The planner for GPUs: roofline step times from the datasheet, the search over TP sizes and instance counts,
and `python -m loadtest plan` on a TensorRT-LLM spec."""
from __future__ import annotations

import argparse
import json
import re
from types import SimpleNamespace

import pytest
import yaml

from disagg.planner import roofline
from disagg.planner import gpu_plan
from disagg.planner.front_cost import front_cost
from disagg.planner.gpu_plan import _candidates, tp_sizes
from disagg.planner.plan import Traffic
from disagg.planner.simulate import EngineLimits
from disagg.spec import SpecError, load_spec
from loadtest import plan_gpus
from trtllm_helpers import LLAMA_3_1_8B, LLAMA_3_1_8B_CONFIG, LLAMA_3_1_8B_PARAMS, ROOT

H200 = roofline.ACCELERATORS["H200"]
MODEL = roofline.ModelShape.of(LLAMA_3_1_8B, 2)
EMBEDDING = 128256 * 4096


def test_the_weights_a_token_multiplies_are_all_but_the_input_embedding_and_the_norms():
    assert MODEL.matmul_weights + EMBEDDING == LLAMA_3_1_8B_PARAMS - 32 * 2 * 4096 - 4096


def test_a_decode_step_reads_the_weights_and_the_kv_a_prompt_computes():
    hbm, gemm, attention = 4.8e12 * 0.8, 989e12 * 0.65, 989e12 * 0.5
    weights_s = MODEL.matmul_weights * 2 / hbm
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16: 128 KiB
    pair_s = 4 * 32 * 32 * 128 / attention  # QK^T and PV of one (query, key) pair
    one = roofline.steps(MODEL, 1, H200)
    assert one.decode_s(1, 0) == pytest.approx(0.5e-3 + weights_s)
    assert one.decode_s(1, 4096) - one.decode_s(1, 0) == pytest.approx(4096 * (kv_per_token / hbm + pair_s))
    assert one.decode_s(512, 0) == pytest.approx(0.5e-3 + 512 * 2 * MODEL.matmul_weights / gemm)  # compute bound
    # a prompt: the layers for every token, the LM head for the last, and attention over n (n + 1) / 2 pairs
    layers_s, head_s = 2 * MODEL.layer_weights / gemm, 2 * 128256 * 4096 / gemm
    for n in (1, 2048, 4096):
        assert one.prefill_s(n) == pytest.approx(0.5e-3 + weights_s + head_s + n * layers_s + n * (n + 1) / 2 * pair_s)
    two = roofline.steps(MODEL, 2, H200)
    reduce_s = 2 * 32 * 8e-6
    assert two.decode_s(1, 0) == pytest.approx(0.5e-3 + reduce_s + weights_s / 2 + 2 * 32 * 4096 * 2 / 450e9)
    memory = 140.4 * 2**30
    assert roofline.kv_capacity_tokens(MODEL, 1, H200, 0.9) == int(0.9 * (memory - MODEL.weight_bytes) / kv_per_token)
    assert roofline.kv_capacity_tokens(MODEL, 2, H200, 0.9) == int(0.9 * (memory - MODEL.weight_bytes / 2) * 2 / kv_per_token)
    # as many links at once as the narrower group has GPUs
    assert roofline.handoff(MODEL, 4, 2, H200, nvlink=True)(1000) == pytest.approx(1e-3 + 1000 * kv_per_token / (2 * 225e9))
    assert roofline.handoff(MODEL, 1, 4, H200, nvlink=False)(1000) == pytest.approx(1e-3 + 1000 * kv_per_token / 40e9)


def test_tied_embeddings_are_stored_once():
    tied = roofline.ModelShape.of({**LLAMA_3_1_8B, "tie_word_embeddings": True}, 2)
    assert MODEL.weight_bytes - tied.weight_bytes == EMBEDDING * 2


def test_candidates_use_the_whole_budget_and_whole_nodes_per_role():
    limits = {"prefill": EngineLimits(8, 8192, False, 32), "decode": EngineLimits(256, 256, True, 32)}
    free = {"prefill": 0.85, "decode": 0.9}
    anywhere = _candidates(MODEL, H200, 8, limits, free, _traffic(), True, {"prefill": 1, "decode": 1}, 300)
    nodes = _candidates(MODEL, H200, 8, limits, free, _traffic(), True, {"prefill": 4, "decode": 4}, 300)
    for c in anywhere + nodes:
        d = c.deployment
        used = d.aggregated * c.tp.get("aggregated", 0) + d.prefill * c.tp.get("prefill", 0) + d.decode * c.tp.get("decode", 0)
        assert used == 8
    splits = {(c.deployment.prefill * c.tp["prefill"], c.deployment.decode * c.tp["decode"]) for c in nodes if not c.deployment.aggregated}
    assert splits == {(4, 4)}
    assert {p for p, _ in {(c.deployment.prefill * c.tp["prefill"], 0) for c in anywhere if not c.deployment.aggregated}} == set(range(1, 8))


def test_tp_sizes_divide_the_heads_and_fit_the_weights():
    assert tp_sizes(MODEL, H200, 8, 0.9) == [1, 2, 4, 8]
    assert tp_sizes(MODEL, H200, 2, 0.9) == [1, 2]
    big = roofline.ModelShape.of({**LLAMA_3_1_8B, "num_hidden_layers": 360}, 2)  # 159 GB of weights
    assert tp_sizes(big, H200, 8, 0.9) == [2, 4, 8]


def _traffic(rate: float = 2.0) -> Traffic:
    return Traffic(((1.0, 2000, 6000),), ((1.0, 16, 32),), rate, ttft_slo_s=1.0, tpot_slo_s=0.02)


def test_two_gpus_every_option_within_its_bound_best_first_and_the_spec_s_own_split_placed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_plan, "SIMULATED_SECONDS", 30.0)  # a quarter of the runs' length, to keep the test short
    front = tmp_path / "front.json"
    front.write_text(json.dumps({"rows": FRONT_ROWS}))
    a = argparse.Namespace(config=yaml_spec(tmp_path, prefill_tp=1, decode_tp=1), gpu="H200",
                           model_config=LLAMA_3_1_8B_CONFIG, front=front)
    assert plan_gpus.run(a, _traffic()) == 0
    out = capsys.readouterr().out
    assert "plan: two-gpus: 2 x H200 SXM, 16.1 GB of weights, KV handoff over NVLink" in out
    assert "roofline estimate, not measured" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("prefill ", "aggregated "))]
    pruned = re.search(r"plan: (\d+) more options not simulated", out)
    # 1 split x decode batch limits 64 and the KV pool's (925k tokens / 6032), aggregated at TP1 and TP2 x 2 budgets
    assert len(rows) + (int(pruned.group(1)) if pruned else 0) == 2 + 4
    split = [r for r in rows if r[0].startswith("prefill 1 x TP1 + decode 1 x TP1 ")]
    assert sorted(int(r[0].split()[-2]) for r in split) == [64, 153]
    bound_goodput = [tuple(float(x) for x in r[1].split()) for r in rows]
    assert all(0 < goodput <= bound * (1 + gpu_plan.PRUNE_MARGIN) for bound, goodput in bound_goodput)  # as pruning assumes
    assert bound_goodput[0][1] >= max(g for _, g in bound_goodput) * 0.98
    assert all(r[2].split()[-1] == "100%" for r in rows)  # 2 req/s is well below every option's goodput
    recommended = next(line for line in out.splitlines() if line.startswith("plan: recommended "))
    assert f"{bound_goodput[0][1]:.1f} req/s within the SLOs" in recommended
    assert re.search(r"plan: this spec's prefill 1 x TP1 \+ decode 1 x TP1, decode batch limit 153: [\d.]+ req/s "
                     r"\(\d+% of the recommended\)", out)
    # the front at the recommended goodput x 24 output tokens, through the ensemble (the spec renders no BLS)
    front_line = next(line for line in out.splitlines() if line.startswith("plan: the front at "))
    assert front_line.startswith(f"plan: the front at {bound_goodput[0][1]:.1f} req/s x 24 output tokens = ")
    assert "tokens/s, through ensemble at 1.20 ms of CPU per token (stub disagg_orchestrator 0.50, tritonserver 0.35, " \
           f"stub postprocessing 0.34, stub preprocessing 0.01; measured at 64 streams, {front}, on that host's cores)" in front_line
    tokens_per_s = float(front_line.split(" = ")[1].split()[0])
    assert abs(tokens_per_s - bound_goodput[0][1] * 24) < 2
    assert front_line.endswith(f": {tokens_per_s * 1.2e-3:.1f} cores busy")
    assert "plan:   disagg_orchestrator: one core at most per instance, needs at least 1, this spec gives it 1\n" in out
    assert "plan:   preprocessing" not in out  # 0.01 ms a token: below what a path's own model spends


def test_the_front_a_deployment_needs_names_each_model_short_of_instances_and_what_to_set(tmp_path, capsys):
    """48.8 req/s x 300 output tokens (the H200 spec's recommendation) = 14640 tokens/s."""
    front = tmp_path / "front.json"
    front.write_text(json.dumps({"rows": FRONT_ROWS}))
    spec = load_spec(yaml_spec(tmp_path, prefill_tp=1, decode_tp=1), LLAMA_3_1_8B_CONFIG)
    traffic = Traffic(((1.0, 1000, 7000),), ((1.0, 100, 500),), 30.0, ttft_slo_s=1.0, tpot_slo_s=0.02)
    plan_gpus.print_front(spec, front, SimpleNamespace(goodput=48.8), traffic)
    out = capsys.readouterr().out
    assert ": 17.6 cores busy" in out  # 14640 x 1.20 ms
    assert "plan:   disagg_orchestrator: one core at most per instance, needs at least 8, this spec gives it 1: short, set " \
           "orchestrator.instances: 8" in out  # 7.32 cores of one model
    assert "plan:   postprocessing: one core at most per instance, needs at least 5, this spec gives it 1: short, and it runs one " \
           "instance: serve through tensorrt_llm_bls (orchestrator.bls: true)" in out  # 4.98 cores
    h200 = load_spec(ROOT / "configs" / "h200x8-intra-node.yaml", LLAMA_3_1_8B_CONFIG)  # sized by later rows: 0.16 ms in the BLS's stub
    plan_gpus.print_front(h200, front, SimpleNamespace(goodput=48.8), traffic)
    lines = capsys.readouterr().out.splitlines()
    assert "through tensorrt_llm_bls at 0.60 ms of CPU per token (stub tensorrt_llm_bls 0.47, tritonserver 0.13;" in lines[0]
    assert lines[1:] == ["plan:   tensorrt_llm_bls: one core at most per instance, needs at least 7, this spec gives it 4: short, "
                         "set orchestrator.instances: 7"]  # 6.88 cores
    rows = [dict(r, cpu_ms_per_token={**r["cpu_ms_per_token"], "stub tensorrt_llm_bls": 0.16}) if r["path"] == "tensorrt_llm_bls" else r
            for r in FRONT_ROWS]
    front.write_text(json.dumps({"rows": rows}))
    plan_gpus.print_front(h200, front, SimpleNamespace(goodput=48.8), traffic)
    assert capsys.readouterr().out.splitlines()[1:] == [
        "plan:   tensorrt_llm_bls: one core at most per instance, needs at least 3, this spec gives it 4"]  # 2.34 cores


# `bench front`'s rows (front.json), as measured on 4 December at 64 streams and 20 ms steps, rounded
FRONT_ROWS = [
    {"path": "ensemble", "streams": 64, "cpu_ms_per_token": {
        "tritonserver": 0.55, "stub disagg_orchestrator": 0.5, "stub postprocessing": 0.34, "client": 0.25, "stub decode": 0.23,
        "stub prefill": 0.04, "stub preprocessing": 0.01}},
    {"path": "ensemble", "streams": 16, "cpu_ms_per_token": {"tritonserver": 9.0, "stub disagg_orchestrator": 9.0}},
    {"path": "tensorrt_llm_bls", "streams": 64, "cpu_ms_per_token": {"stub tensorrt_llm_bls": 0.47, "tritonserver": 0.33}},
    {"path": "prefill + decode", "streams": 64, "cpu_ms_per_token": {"client": 0.22, "stub decode": 0.21, "tritonserver": 0.2}},
    {"path": "prefill + decode", "streams": 16, "cpu_ms_per_token": {"tritonserver": 0.1}},
]


def test_the_front_cost_counts_the_front_s_models_and_what_tritonserver_spends_beyond_the_engines(tmp_path):
    """At the highest level both paths were measured; the engines' stubs and the client are not the front."""
    source = tmp_path / "front.json"
    source.write_text(json.dumps({"rows": FRONT_ROWS}))
    bls = front_cost(source, "tensorrt_llm_bls")
    assert (bls.streams, bls.ms_per_token) == (64, {"stub tensorrt_llm_bls": 0.47, "tritonserver": pytest.approx(0.13)})
    assert bls.cores(10_000) == pytest.approx(6.0)
    assert bls.instances(10_000) == {"tensorrt_llm_bls": 5}  # 4.7 cores of one model's stub
    assert bls.instances(100) == {"tensorrt_llm_bls": 1}
    source.write_text(json.dumps({"rows": FRONT_ROWS[:3]}))
    with pytest.raises(SystemExit, match=r"no level measured both through tensorrt_llm_bls and with the engines called directly"):
        front_cost(source, "tensorrt_llm_bls")


def test_the_cli_refuses_pipeline_parallelism_pools_and_an_unknown_gpu(tmp_path):
    a = argparse.Namespace(config=yaml_spec(tmp_path, prefill_tp=1, decode_tp=1, decode_pp=2), gpu="H200",
                           model_config=LLAMA_3_1_8B_CONFIG, front=None)
    with pytest.raises(SpecError, match=r"roles.decode.pp: 2: the roofline planner models tensor parallelism only"):
        plan_gpus.run(a, _traffic())
    with pytest.raises(SystemExit, match=r"--gpu: 'B300' has no datasheet figures here \(known: H200, H100, A100\)"):
        plan_gpus.accelerator("B300")
    pools = argparse.Namespace(config=ROOT / "configs" / "k8s-pools.yaml", gpu="H200",
                               model_config=LLAMA_3_1_8B_CONFIG, front=None)
    with pytest.raises(SpecError, match=r"pools: the roofline planner plans one kind of GPU for the spec's own devices"):
        plan_gpus.run(pools, _traffic())


def yaml_spec(tmp_path, prefill_tp: int, decode_tp: int, decode_pp: int = 1):
    """configs/h200x8-intra-node.yaml cut to one prefill and one decode instance on GPUs 0.. and after, served
    through the ensemble by one orchestrator instance."""
    raw = yaml.safe_load((ROOT / "configs" / "h200x8-intra-node.yaml").read_text())
    raw["name"] = "two-gpus"
    raw["orchestrator"] = {"instances": 1}
    raw["roles"]["prefill"].update(tp=prefill_tp, instances=1, devices=[list(range(prefill_tp))])
    raw["roles"]["decode"].update(tp=decode_tp, pp=decode_pp, instances=1,
                                  devices=[list(range(prefill_tp, prefill_tp + decode_tp * decode_pp))])
    path = tmp_path / "two-gpus.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
