"""`python -m loadtest compare`: both deployments in turn on a real tritonserver, then the ratios."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from loadtest.compare import check_fits, compare_spec, deployment_models
from loadtest.workload import LengthBin, load_workload

ROOT = Path(__file__).resolve().parent.parent


def compare(project: Path, *args: str, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "loadtest", "compare", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_equal_budget_spec_gives_aggregated_as_many_engine_instances(new_project, tmp_path):
    project = new_project("budget")
    with contextlib.chdir(project):
        spec, budget = compare_spec(Path("configs/cpu-tiny.yaml"), tmp_path)
    assert spec.roles["aggregated"].instances == spec.roles["prefill"].instances + spec.roles["decode"].instances == 2
    assert spec.model_repository == tmp_path / "model_repository"
    assert yaml.safe_load((tmp_path / "spec.yaml").read_text())["roles"]["aggregated"]["instances"] == 2
    assert "aggregated = 2 aggregated_engine instance(s)" in budget and "prefill 1 + decode 1" in budget
    assert "OMP_NUM_THREADS=1" in budget
    assert deployment_models(spec, "aggregated") == (
        "aggregated", ["preprocessing", "postprocessing", "aggregated_engine", "aggregated_orchestrator", "aggregated"])
    assert deployment_models(spec, "disaggregated") == (
        "ensemble", ["preprocessing", "postprocessing", "prefill", "decode", "disagg_orchestrator", "ensemble"])


def test_workload_that_does_not_fit_the_limits_fails_early(new_project, tmp_path):
    with contextlib.chdir(new_project("fits")):
        spec, _ = compare_spec(Path("configs/cpu-tiny.yaml"), tmp_path)
    check_fits(spec, load_workload("mixed"))
    too_long = replace(load_workload("mixed"), prompt_tokens=(LengthBin(1.0, 200, 240),))
    with pytest.raises(SystemExit, match=r"prompts up to 264 tokens \(special tokens included\) and 64 new tokens do not fit"):
        check_fits(spec, too_long)


@pytest.mark.e2e
def test_quick_compare_runs_both_deployments_and_prints_the_ratios(new_project, tmp_path):
    project = new_project("compare")
    out = tmp_path / "out"
    proc = compare(project, "--quick", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = proc.stdout
    assert "equal CPU budget: aggregated = 2 aggregated_engine instance(s)" in text
    assert "[aggregated-2users] 8 requests, 0 errors" in text
    assert "[disaggregated-2users] 8 requests, 0 errors" in text
    assert any(line.split() == ["aggregated", "disaggregated", "disagg/agg"] for line in text.splitlines())
    ratios = next(line for line in text.splitlines() if line.startswith("2 users (closed loop): disagg/agg"))
    for name in ("p95 ITL", "p50 TTFT", "request goodput"):
        assert name in ratios
    assert "decode: KV blocks in use max" in text and "KV handoff" in text  # metrics summary per role
    for name in ("report.json", "report.csv", "latency_cdf.png", "itl_over_time.png", "metrics_aggregated.png",
                 "metrics_disaggregated.png", "spec.yaml", "server-aggregated-2users.log", "server-disaggregated-2users.log"):
        assert (out / name).is_file(), name
    assert not (project / "model_repository").exists()  # the project's own repository is not touched


@pytest.mark.benchmark  # not also e2e: `-m e2e` must not pull in a run of several minutes
def test_full_size_compare(new_project, tmp_path):
    """The default: workload `mixed` at its sweep rates on each deployment (several minutes)."""
    proc = compare(new_project("compare-full"), "--out", str(tmp_path / "out"), timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "goodput (DistServe" in proc.stdout
