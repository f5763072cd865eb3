"""`python -m loadtest crossover`: prompt-length variants, the verdicts, and a short real run."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.compare import check_fits, compare_spec
from loadtest.crossover import Point, length_variant, table, verdicts
from loadtest.report import RunStats
from loadtest.workload import WORKLOAD_DIR

ROOT = Path(__file__).resolve().parent.parent


def test_prompt_length_variants_fit_cpu_bench_up_to_1920_tokens(tmp_path):
    base = WORKLOAD_DIR / "prefill-heavy.yaml"
    path, workload = length_variant(base, 1920, 12.0, tmp_path)
    assert path.parent == tmp_path / "workloads" and workload.name == "prefill-heavy-1920"
    assert [(b.min, b.max) for b in workload.prompt_tokens] == [(1728, 1920)] and workload.duration_s == 12.0
    with contextlib.chdir(ROOT):
        spec, _ = compare_spec(Path("configs/cpu-bench.yaml"), tmp_path)
    assert spec.roles["aggregated"].enable_chunked_context and spec.roles["aggregated"].max_num_tokens == 256
    check_fits(spec, workload)  # 1920 + 128 new tokens = max_seq_len 2048
    with pytest.raises(SystemExit, match=r"prompts up to 2000 tokens .* do not fit max_input_len=1920"):
        check_fits(spec, length_variant(base, 2000, None, tmp_path)[1])


def _stats(deployment: str, rate: float, itl_p95: float, ttft_p50: float, attainment: float) -> RunStats:
    p = {"p50": None, "p95": None, "p99": None, "mean": None}
    return RunStats(deployment, rate, 32, 10, 0, 0, 10.0, {**p, "p50": ttft_p50}, p, {**p, "p95": itl_p95}, p,
                    100.0, 1.0, attainment, attainment, None)


def test_verdicts_find_where_disaggregated_wins_on_itl_and_goodput():
    points = [
        Point(256, 1.0, _stats("aggregated", 1.0, 10, 50, 1.0), _stats("disaggregated", 1.0, 12, 60, 1.0), {}),
        Point(256, 2.0, _stats("aggregated", 2.0, 12, 55, 0.95), _stats("disaggregated", 2.0, 14, 70, 0.92), {}),
        Point(1920, 1.0, _stats("aggregated", 1.0, 100, 900, 0.95), _stats("disaggregated", 1.0, 40, 1200, 1.0), {}),
        Point(1920, 2.0, _stats("aggregated", 2.0, 160, 1500, 0.5), _stats("disaggregated", 2.0, 60, 2000, 0.91), {}),
    ]
    lines, goodputs = verdicts(points)
    assert goodputs == {256: {"aggregated": 2.0, "disaggregated": 2.0}, 1920: {"aggregated": 1.0, "disaggregated": 2.0}}
    assert lines == [
        "256 tokens: p95 ITL lower disaggregated at none of 1, 2 req/s (<= 0.5x at none); "
        "goodput aggregated 2.00 vs disaggregated 2.00 req/s (1.00x)",
        "1920 tokens: p95 ITL lower disaggregated at 1, 2 of 1, 2 req/s (<= 0.5x at 1, 2); "
        "goodput aggregated 1.00 vs disaggregated 2.00 req/s (2.00x)",
    ]
    row = table(points)[3].split("|")
    assert [c.strip() for c in row] == ["1920     1", "100", "40", "0.40", "900", "1200", "1.33", "95%", "100%"]


@pytest.mark.e2e
def test_a_short_crossover_runs_every_point_on_both_deployments(new_project, tmp_path):
    """On cpu-tiny (the bench model's run takes minutes a point): one length, one rate, both deployments, each
    on a server of its own (the table and verdicts over several lengths are checked above, from data)."""
    project, out = new_project("crossover"), tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "crossover", "--config", "configs/cpu-tiny.yaml", "--workload", "quick",
         "--prompt-tokens", "100", "--rates", "2", "--seconds", "3", "--out", str(out)],
        cwd=project, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in ("aggregated-2rps", "disaggregated-2rps"):
        assert (out / "100tokens" / "samples" / f"{name}.jsonl").is_file()
    result = json.loads((out / "crossover.json").read_text())
    assert [(p["prompt_tokens"], p["rate"]) for p in result["points"]] == [(100, 2.0)]
    for p in result["points"]:
        for deployment in ("aggregated", "disaggregated"):
            assert p[deployment]["requests"] >= 3 and p[deployment]["errors"] == 0
            assert p[deployment]["itl_ms"]["p95"] > 0
            assert p["samples"][deployment] == f"{p['prompt_tokens']}tokens/samples/{deployment}-2rps.jsonl"
    assert [line.split(":")[0] for line in result["verdicts"]] == ["100 tokens"]
    assert result["verdicts"][0] in proc.stdout
