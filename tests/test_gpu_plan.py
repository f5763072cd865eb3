"""The planner for GPUs: roofline step times from the datasheet, the search over TP sizes and instance counts,
and `python -m loadtest plan` on a TensorRT-LLM spec."""
from __future__ import annotations

import argparse
import re

import pytest
import yaml

from disagg.planner import roofline
from disagg.planner import gpu_plan
from disagg.planner.gpu_plan import _candidates, tp_sizes
from disagg.planner.plan import Traffic
from disagg.planner.simulate import EngineLimits
from disagg.spec import SpecError
from loadtest import plan_gpus
from trtllm_helpers import LLAMA_3_1_8B, LLAMA_3_1_8B_PARAMS, ROOT

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
    a = argparse.Namespace(config=yaml_spec(tmp_path, prefill_tp=1, decode_tp=1), gpu="H200",
                           model_config=ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct.json")
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


def test_the_cli_refuses_pipeline_parallelism_pools_and_an_unknown_gpu(tmp_path):
    a = argparse.Namespace(config=yaml_spec(tmp_path, prefill_tp=1, decode_tp=1, decode_pp=2), gpu="H200",
                           model_config=ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct.json")
    with pytest.raises(SpecError, match=r"roles.decode.pp: 2: the roofline planner models tensor parallelism only"):
        plan_gpus.run(a, _traffic())
    with pytest.raises(SystemExit, match=r"--gpu: 'B300' has no datasheet figures here \(known: H200, H100, A100\)"):
        plan_gpus.accelerator("B300")
    pools = argparse.Namespace(config=ROOT / "configs" / "k8s-pools.yaml", gpu="H200",
                               model_config=ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct.json")
    with pytest.raises(SpecError, match=r"pools: the roofline planner plans one kind of GPU for the spec's own devices"):
        plan_gpus.run(pools, _traffic())


def yaml_spec(tmp_path, prefill_tp: int, decode_tp: int, decode_pp: int = 1):
    """configs/h200x8-intra-node.yaml cut to one prefill and one decode instance on GPUs 0.. and after."""
    raw = yaml.safe_load((ROOT / "configs" / "h200x8-intra-node.yaml").read_text())
    raw["name"] = "two-gpus"
    raw["roles"]["prefill"].update(tp=prefill_tp, instances=1, devices=[list(range(prefill_tp))])
    raw["roles"]["decode"].update(tp=decode_tp, pp=decode_pp, instances=1,
                                  devices=[list(range(prefill_tp, prefill_tp + decode_tp * decode_pp))])
    path = tmp_path / "two-gpus.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path
