"""`python -m loadtest splits`: one spec per split, goodput from the runs, the verdict."""
from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

import pytest
import yaml

from loadtest.calibration import split_spec
from loadtest.compare import THREAD_ENV
from loadtest.crossover import length_variant
from loadtest.plan import main as plan_main
from loadtest.report import highest_met_rate
from loadtest.splits import (
    Run, against_aggregated, prediction_errors, rates_around, run_to_run, stand_in, sustained, verdict,
)
from loadtest.workload import workload_file

ROOT = Path(__file__).resolve().parent.parent


def test_each_split_gets_its_instances_and_its_own_repository(tmp_path):
    with contextlib.chdir(ROOT):
        spec = split_spec(Path("configs/cpu-bench.yaml"), tmp_path, 3, 2)
    assert {role: r.instances for role, r in spec.roles.items()} == {"prefill": 2, "decode": 1, "aggregated": 3}
    assert spec.model_repository == tmp_path / "prefill2-decode1" / "model_repository"
    assert spec.build_dir == Path("build/cpu-bench")  # the engines are shared by every split


def test_a_sharded_role_is_refused(tmp_path, monkeypatch):
    raw = yaml.safe_load((ROOT / "configs/cpu-bench.yaml").read_text())
    raw["roles"]["decode"]["tp"] = 2
    config = tmp_path / "tp2.yaml"
    config.write_text(yaml.safe_dump(raw))
    refusal = r"roles.decode: a split counts one engine rank per instance, and tp \* pp is not 1"
    with pytest.raises(SystemExit, match=refusal):
        split_spec(config, tmp_path, 3, 1)
    for name, value in THREAD_ENV.items():  # plan sets them for its servers; restored after the test
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit, match=refusal):  # plan, which calibrates each split, refuses it before any work
        plan_main(["--config", str(config), "--instances", "3", "--out", str(tmp_path / "plan")])
    assert not (tmp_path / "plan").exists()


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
    once = {"prefill x2 + decode x1": 0.2, "prefill x1 + decode x2": 0.18, "aggregated x3": 0.28}
    assert verdict({"prefill x2 + decode x1": 0.2, "prefill x1 + decode x2": 0.1, "aggregated x3": 0.3}, predicted, once).endswith(
        "the choice measured 0.2 req/s = 67% of the best; calibrated once per kind it would choose aggregated x3, "
        "which measured 0.3 req/s = 100% of the best")
    assert verdict({"prefill x2 + decode x1": 0.2}, {"prefill x2 + decode x1": 0.3}, {"prefill x2 + decode x1": 0.1}).endswith("= 100% of the best")


def test_the_best_split_is_set_beside_aggregated_run_for_run():
    def runs(*cells):
        return [Run(rate, (0.0, 0.0), (attained, 0.0), itl_p95_ms=itl) for rate, attained, itl in cells]
    measured = {"prefill x1 + decode x2": runs((1.0, 1.0, 30.0), (2.0, 0.5, 40.0)),
                "prefill x2 + decode x1": runs((1.0, 1.0, 25.0), (2.0, 0.95, 80.0)),
                "aggregated x3": runs((1.0, 1.0, 20.0), (2.0, 0.6, 320.0))}
    goodput = {"prefill x1 + decode x2": 1.0, "prefill x2 + decode x1": 2.0, "aggregated x3": 1.0}
    assert against_aggregated(measured, goodput, "aggregated x3") == (
        "splits: at equal instances, prefill x2 + decode x1 against aggregated x3: goodput 2 req/s (met at the highest "
        "rate run: at least) against 1 req/s (2.00x); p95 ITL 1 req/s 25 / 20 ms (1.25x); 2 req/s 80 / 320 ms (0.25x)")
    # a tie in goodput goes to the split with the higher attainment; none met and no gaps measured are said so
    tied = {**goodput, "prefill x2 + decode x1": 1.0, "aggregated x3": None}
    unmeasured = {name: [Run(r.rate, r.ttft_p50_ms, r.attainment) for r in rs] for name, rs in measured.items()}
    assert against_aggregated(unmeasured, tied, "aggregated x3") == (
        "splits: at equal instances, prefill x2 + decode x1 against aggregated x3: goodput 1 req/s against none; "
        "p95 ITL not measured")


def test_prediction_errors_count_the_runs_within_a_fifth_and_leave_out_those_without_a_prediction():
    nan = float("nan")
    runs = {"prefill x2 + decode x1": [Run(1.5, (700.0, 770.0), (1.0, 1.0), (50.0, 30.0), (0.06, 0.05),  # TTFT +10%, TPOT -40%
                                           shared_ms=(910.0, 35.0)),  # calibrated once per kind: +30%, -30%
                                       Run(2.0, (800.0, 1040.0), (1.0, 1.0), (80.0, 88.0), (0.25, 0.05),  # +30%, +10%
                                           shared_ms=(840.0, 100.0))],  # +5%, +25%
              "aggregated x3": [Run(1.5, (900.0, nan), (0.0, 0.0), (60.0, nan), shared_ms=(nan, nan))]}
    line = prediction_errors(runs)
    assert line == ("splits: predicted, each deployment calibrated at load on itself: p50 TTFT within 20% in 1 of 2 runs "
                    "(median error 20%), and in 1 of 1 runs (median error 10%) where a 5% slower machine moves the prediction "
                    "by under 20%; p50 TPOT within 20% in 1 of 2 runs (median error 25%), and in 1 of 2 runs (median error 25%) "
                    "where a 5% slower machine moves the prediction by under 20%; calibrated at load once per kind, on the "
                    "first split and aggregated: p50 TTFT in 1 of 2 runs (median error 18%), p50 TPOT in 0 of 2 runs (median error 28%)")
    unmeasured = {"aggregated x3": [Run(1.5, (700.0, 770.0), (1.0, 1.0), (50.0, 55.0))]}  # saved before runs had these
    assert "in no run where a 5% slower machine" in prediction_errors(unmeasured)
    assert "once per kind" not in prediction_errors(unmeasured)
    assert prediction_errors({}) == "splits: no run to check the predictions against"


def test_auto_rates_bracket_every_deployment_s_predicted_goodput():
    rates = rates_around([0.70, 1.03, 1.0])
    assert rates == [0.42, 0.58, 0.81, 1.1, 1.5]  # 0.6 x 0.70 to 1.5 x 1.03, evenly on a log scale
    assert rates_around([0.0, 2.0]) == [1.2, 1.5, 1.9, 2.4, 3.0]  # a deployment that never meets the SLOs sets no bound
    with pytest.raises(SystemExit, match="predicts that no deployment meets the SLOs at any rate; give --rates"):
        rates_around([0.0, 0.0])


def test_every_run_lasts_its_seconds_at_the_top_rate_not_the_workload_s_sixty_requests(tmp_path):
    path, base = length_variant(workload_file("prefill-heavy"), 512, 60.0, tmp_path)
    assert (base.max_requests, base.duration_s) == (60, 60.0)  # 4.2 req/s would end after 14 s
    path, runs = sustained(path, 4.2, 60.0, tmp_path)
    assert (runs.max_requests, runs.duration_s, runs.name) == (252, 60.0, "prefill-heavy-512-runs")
    assert [(b.min, b.max) for b in runs.prompt_tokens] == [(460, 512)]  # the length variant's prompts, kept
    last = runs.with_rate(4.2).arrivals()[-1]
    assert 50.0 < last < 70.0  # the 252nd planned about 60 s in: the run ends by its duration, not its count


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
