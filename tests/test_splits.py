"""`python -m loadtest splits`: one spec per split, goodput from the runs, the verdict."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml

from loadtest.report import highest_met_rate
from loadtest.splits import Run, split_spec, verdict

ROOT = Path(__file__).resolve().parent.parent


def test_each_split_gets_its_instances_and_its_own_repository(tmp_path):
    with contextlib.chdir(ROOT):
        spec = split_spec(Path("configs/cpu-bench.yaml"), tmp_path, 3, 2)
    assert {role: r.instances for role, r in spec.roles.items()} == {"prefill": 2, "decode": 1, "aggregated": 3}
    assert spec.model_repository == tmp_path / "prefill2-decode1" / "model_repository"
    assert spec.build_dir == Path("build/cpu-bench")  # the engines are shared by every split


def test_a_sharded_role_is_refused(tmp_path):
    raw = yaml.safe_load((ROOT / "configs/cpu-bench.yaml").read_text())
    raw["roles"]["decode"]["tp"] = 2
    config = tmp_path / "tp2.yaml"
    config.write_text(yaml.safe_dump(raw))
    with pytest.raises(SystemExit, match=r"roles.decode: splits counts one engine rank per instance, and tp \* pp is not 1"):
        split_spec(config, tmp_path, 3, 1)


def test_goodput_is_the_last_rate_before_the_first_miss():
    runs = [Run(0.1, (1.0, 1.0), (1.0, 0.95)), Run(0.3, (1.0, 1.0), (0.95, 0.5)), Run(0.2, (1.0, 1.0), (0.8, 0.92))]
    assert highest_met_rate((r.rate, r.attainment[0]) for r in runs) == 0.1  # 0.2 missed (80%): 0.3 does not count though it met
    assert highest_met_rate((r.rate, r.attainment[1]) for r in runs) == 0.2
    assert highest_met_rate([(0.1, 0.5)]) is None


def test_the_verdict_rates_the_choice_against_the_measured_best():
    predicted = {"prefill x2 + decode x1": 0.31, "prefill x1 + decode x2": 0.18, "aggregated x3": 0.25}
    line = verdict({"prefill x2 + decode x1": 0.2, "prefill x1 + decode x2": 0.1, "aggregated x3": 0.3}, predicted)
    assert line == ("splits: the planner chooses prefill x2 + decode x1 (predicted 0.31 req/s); measured best aggregated x3 "
                    "(0.3 req/s); the choice measured 0.2 req/s = 67% of the best")
    assert "nothing to compare" in verdict({name: None for name in predicted}, predicted)
