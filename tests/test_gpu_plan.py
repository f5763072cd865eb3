"""The planner for GPUs: roofline step times from the datasheet, the search over TP sizes and instance counts,
and `python -m loadtest plan` on a TensorRT-LLM spec."""
from __future__ import annotations

import argparse
import re

import pytest
import yaml

from disagg.planner import roofline
from disagg.planner.gpu_plan import tp_sizes
from disagg.planner.plan import Traffic
from disagg.spec import SpecError
from loadtest import plan_gpus
from trtllm_helpers import LLAMA_3_1_8B, LLAMA_3_1_8B_PARAMS, ROOT

H200 = roofline.ACCELERATORS["H200"]
MODEL = roofline.ModelShape.of(LLAMA_3_1_8B, 2)
EMBEDDING = 128256 * 4096


def test_the_weights_a_token_multiplies_are_all_but_the_input_embedding_and_the_norms():
    assert MODEL.matmul_weights + EMBEDDING == LLAMA_3_1_8B_PARAMS - 32 * 2 * 4096 - 4096


def test_a_decode_step_reads_the_weights_and_the_kv_a_prompt_computes():
    hbm = 4.8e12 * 0.8
    weights_s = MODEL.matmul_weights * 2 / hbm
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads of 128, bf16: 128 KiB
    one = roofline.steps(MODEL, 1, H200)
    assert one.decode_s(1, 0) == pytest.approx(0.5e-3 + weights_s)
    assert one.decode_s(1, 4096) - one.decode_s(1, 0) == pytest.approx(4096 * (kv_per_token / hbm + 4 * 32 * 32 * 128 / (989e12 * 0.5)))
    per_token = 2 * MODEL.matmul_weights / (989e12 * 0.65)
    assert one.decode_s(512, 0) == pytest.approx(0.5e-3 + 512 * per_token)  # compute bound at a large batch
    assert one.prefill_s(4096) - one.prefill_s(2048) > 2048 * per_token  # and attention grows as the square
    two = roofline.steps(MODEL, 2, H200)
    reduce_s = 2 * 32 * 8e-6
    assert two.decode_s(1, 0) == pytest.approx(0.5e-3 + reduce_s + weights_s / 2 + 2 * 32 * 4096 * 2 / 450e9)
    assert roofline.kv_capacity_tokens(MODEL, 1, H200, 0.9) == int(0.9 * (140.4 * 2**30 - MODEL.weight_bytes) / kv_per_token)
    assert roofline.handoff(MODEL, 4, H200, nvlink=True)(1000) == pytest.approx(1e-3 + 1000 * kv_per_token / 4 / 225e9)


def test_tp_sizes_divide_the_heads_and_fit_the_weights():
    assert tp_sizes(MODEL, H200, 8, 0.9) == [1, 2, 4, 8]
    assert tp_sizes(MODEL, H200, 2, 0.9) == [1, 2]
    big = roofline.ModelShape.of({**LLAMA_3_1_8B, "num_hidden_layers": 360}, 2)  # 159 GB of weights
    assert tp_sizes(big, H200, 8, 0.9) == [2, 4, 8]


def _traffic(rate: float = 2.0) -> Traffic:
    return Traffic(((1.0, 2000, 6000),), ((1.0, 16, 32),), rate, ttft_slo_s=1.0, tpot_slo_s=0.02)


def test_two_gpus_every_option_within_its_bound_best_first_and_the_spec_s_own_split_placed(tmp_path, capsys):
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
    assert all(0 < goodput <= bound for bound, goodput in bound_goodput)
    assert bound_goodput[0][1] >= max(g for _, g in bound_goodput) * 0.98
    assert all(r[2].split()[-1] == "100%" for r in rows)  # 2 req/s is well below every option's goodput
    recommended = next(line for line in out.splitlines() if line.startswith("plan: recommended "))
    assert f"{bound_goodput[0][1]:.1f} req/s within the SLOs" in recommended
    assert re.search(r"plan: this spec's prefill 1 x TP1 \+ decode 1 x TP1: [\d.]+ req/s \(\d+% of the recommended\)", out)


def test_the_cli_refuses_pipeline_parallelism_and_an_unknown_gpu(tmp_path):
    a = argparse.Namespace(config=yaml_spec(tmp_path, prefill_tp=1, decode_tp=1, decode_pp=2), gpu="H200",
                           model_config=ROOT / "configs" / "models" / "Llama-3.1-8B-Instruct.json")
    with pytest.raises(SpecError, match=r"roles.decode.pp: 2: the roofline planner models tensor parallelism only"):
        plan_gpus.run(a, _traffic())
    with pytest.raises(SystemExit, match=r"--gpu: 'B300' has no datasheet figures here \(known: H200, H100, A100\)"):
        plan_gpus.accelerator("B300")


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
