"""`python -m loadtest splits`: one spec per split, goodput from the runs, the verdict."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import pytest
import yaml

from loadtest.report import highest_met_rate
from loadtest.splits import Run, prediction_errors, run_to_run, split_spec, stand_in, verdict

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


def test_prediction_errors_count_the_runs_within_a_fifth_and_leave_out_those_without_a_prediction():
    runs = {"prefill x2 + decode x1": [Run(1.5, (700.0, 770.0), (1.0, 1.0), (50.0, 30.0)),  # TTFT +10%, TPOT -40%
                                       Run(2.0, (800.0, 1040.0), (1.0, 1.0), (80.0, 88.0))],  # +30%, +10%
              "aggregated x3": [Run(1.5, (900.0, float("nan")), (0.0, 0.0), (60.0, float("nan")))]}
    line = prediction_errors(runs)
    assert line == ("splits: predicted p50 TTFT within 20% in 1 of 2 runs (median error 20%); "
                    "p50 TPOT within 20% in 1 of 2 runs (median error 25%)")
    assert prediction_errors({}) == "splits: no run to check the predictions against"


def test_run_to_run_says_how_far_the_same_runs_moved():
    first = [Run(1.5, (2000.0, 2800.0), (0.8, 0.7), (40.0, 27.0)), Run(2.0, (5800.0, 6000.0), (0.3, 0.3), (40.0, 27.0))]
    again = [Run(1.5, (2500.0, 2800.0), (0.7, 0.7), (36.0, 27.0)), Run(2.0, (5220.0, 6000.0), (0.25, 0.3), (44.0, 27.0))]
    line = run_to_run("prefill x1 + decode x2", first, again)
    assert line == ("splits: prefill x1 + decode x2 measured first and again last: "
                    "1.5 req/s: attainment 80% then 70%, p50 TTFT 2000 then 2500 ms (+25%), p50 TPOT 40 then 36 ms (-10%); "
                    "2 req/s: attainment 30% then 25%, p50 TTFT 5800 then 5220 ms (-10%), p50 TPOT 40 then 44 ms (+10%). "
                    "The same runs moved by p50 TTFT up to 25%, p50 TPOT up to 10%")


def test_a_stand_in_is_two_times_and_a_step_that_takes_none_is_refused():
    assert stand_in("20,1.5") == (20.0, 1.5)
    assert stand_in("0,2") == (0.0, 2.0)
    for text, message in (("20", "expected STEP_MS,TOKEN_MS"), ("a,b", "expected STEP_MS,TOKEN_MS"),
                          ("20,-1", "both at least 0"), ("0,0", "STEP_MS or TOKEN_MS above 0")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            stand_in(text)
