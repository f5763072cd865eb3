"""`python -m loadtest splits`: the planner's choice of split against the best one found by measurement.

    python -m loadtest splits                                  # 3 instances of cpu-bench, 512-token prompts
    python -m loadtest splits --instances 3 --prompt-tokens 1024 --rates 0.05,0.1,0.2 --seconds 90

Every prefill:decode split of `--instances` engine instances (1:2 and 2:1 for 3) and aggregated x N serve
the workload in turn, each at every rate on a fresh server for `--seconds` (however many requests that
takes: a rate sustained, not a burst), all on this machine's cores (more instances than cores share them, as
the planner's `Host` has them share). The rates are placed around the deployments'
predicted goodputs unless `--rates` gives them. Each deployment's measured goodput (the highest
rate before the first whose attainment is under 90%) is printed beside the planner's prediction (`loadtest
plan`'s profile, front cost, calibration and simulation, all measured just before the runs), and each run's
measured p50 TTFT, p50 TPOT and attainment beside the planner's on that run's own requests, and how fast the
machine ran an engine alone around the run against when it was profiled (`SpeedProbe`, read before and after
it; printed, not applied: the machine read 5-10% faster between runs while the runs' steps took longer, and
predictions scaled by it came within 20% of measured in fewer runs, p50 TPOT 3 of 15 against 6 of 15 unscaled,
docs/measurements.md). Where the engines compute on the cores, each deployment is first calibrated at load on
itself (`fitted_at_load`: 60 requests at its predicted goodput) just before its runs, as `loadtest plan` calibrates
each candidate, and its runs' predictions rest on that: the machine drifts by more than 5% over a session, and which
engines share the cores changes how much they slow each other (replayed over seven saved runs, fitting each
deployment on itself put p50 TPOT within 20% in 65 of 84 runs, one fit per kind in 58). The predictions with one
calibration per kind, on the first split and aggregated, are printed beside them. Then the planner's choice (the
most goodput predicted, each deployment calibrated on itself; and the choice one calibration per kind would make
where it differs), the measured best, and the choice's measured goodput as a share of the best; the best
measured split beside aggregated x N, goodput and p95 ITL run for run (where disaggregation pays); and how many
of the predicted p50 TTFT and TPOT came within 20% of measured: over all runs, and over those whose prediction
moves by less than that on a machine 5% slower (near a deployment's capacity a prediction moves by more, and no
run there can check a 20% bound on a machine whose speed moves by more than 5%). Last, the first deployment serves its rates
again (`--no-repeat`: not): how far the same runs moved between the start and the end of the session is
how finely this machine lets the predictions be checked. Writes <out>/splits.json. A benchmark: minutes
per run.

`--stand-in STEP_MS,TOKEN_MS` serves the same deployments with engines that stand in for GPUs: each step takes
STEP_MS + TOKEN_MS per token it computes without the CPU (disagg.engine.no_compute; the tokens are not the model's),
profiled as such, and the planner simulates them off the cores (`Host.engines_on_cpu` false), as it plans GPU
deployments. The engines then no longer share the cores with each other or the front, so the check is of what
the planner models on GPUs (batching, queues, handoffs, the front's latency), and more instances than cores can
be split (`--instances 4`).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path

import numpy as np

from disagg.cli import build
from disagg.engine.no_compute import skipped_compute
from disagg.planner.plan import Planner
from disagg.planner.profile import SpeedProbe
from disagg.planner.simulate import Deployment
from disagg.spec import DeploymentSpec
from loadtest.compare import THREAD_ENV, check_fits, run_point
from loadtest.crossover import length_variant
from loadtest.calibration import ROLES, calibrated, deployment_dir, deployment_of, fitted_at_load, split_spec, traffic_of
from loadtest.plan import handoff, hosts, limits_of, orchestrators_of, predicted_run, profiles
from loadtest.report import Slo, highest_met_rate, run_stats
from loadtest.samples import read_samples
from loadtest.workload import Workload, workload_file, workload_variant


@dataclass(frozen=True)
class Run:
    rate: float
    ttft_p50_ms: tuple[float, float]  # measured, predicted
    attainment: tuple[float, float]
    tpot_p50_ms: tuple[float, float] = (0.0, 0.0)
    # How far the predicted p50 TTFT and TPOT move (fractions) on a machine SLOWER_STEP times slower
    sensitivity: tuple[float, float] = (float("nan"), float("nan"))
    itl_p95_ms: float = float("nan")  # measured only: the simulation times steps, not the gaps a client sees
    slowdown: float = 1.0  # how much slower the machine ran an engine alone around the run than when profiled (SpeedProbe)
    # p50 TTFT and TPOT (ms) predicted with the calibration at load of the first split or aggregated, one per kind,
    # where the predictions above are calibrated at load on this deployment itself
    shared_ms: tuple[float, float] = (float("nan"), float("nan"))

    def p50_ms(self, at: int) -> tuple[float, float]:
        """Measured and predicted p50 TTFT (`at` 0) or TPOT (1)."""
        return (self.ttft_p50_ms, self.tpot_p50_ms)[at]


# Near a deployment's capacity its queues grow with any shortfall: there a machine 5% slower moves a predicted
# p50 by more than the 20% bound (in the saved runs of 4 December, aggregated x3's p50 TPOT by 12-20%,
# prefill x2 + decode x1's p50 TTFT by 21-23%), and this machine's speed moves by more than 5% between a
# calibration and the runs minutes later. Such a run cannot check the bound, whatever the model.
SLOWER_STEP = 1.05


def verdict(measured: dict[str, float | None], predicted: dict[str, float], once_per_kind: dict[str, float] | None = None) -> str:
    """The planner's choice (the most goodput predicted, each deployment calibrated on itself as `loadtest plan` does)
    against the measured best; and, where `once_per_kind` (one calibration per kind) would choose otherwise, that choice."""
    choice = max(predicted, key=lambda name: predicted[name])
    other = max(once_per_kind, key=lambda name: once_per_kind[name]) if once_per_kind else choice
    aside = "" if other == choice else f"; calibrated once per kind it would choose {other}"
    if not any(measured.values()):
        return f"splits: the planner chooses {choice}{aside}; no deployment met the SLOs at any rate measured: nothing to compare"
    best = max(measured, key=lambda name: measured[name] or 0.0)

    def share(name: str) -> str:
        return f"{measured[name] or 0:g} req/s = {(measured[name] or 0.0) / measured[best]:.0%} of the best"

    return (f"splits: the planner chooses {choice} (predicted {predicted[choice]:.2f} req/s); measured best {best} "
            f"({measured[best]:g} req/s); the choice measured {share(choice)}" + (f"{aside}, which measured {share(other)}" if aside else ""))


ERROR_BOUND = 0.2  # how close to measured the planner's latency predictions are meant to come


def _relative(a: float, b: float) -> float:
    """a against b, as a signed fraction of b."""
    return a / b - 1 if b else float("nan")


def prediction_errors(runs: dict[str, list[Run]]) -> str:
    """How many runs' p50 TTFT and p50 TPOT were predicted within ERROR_BOUND of measured, and the median error;
    then the same over the runs whose prediction a machine SLOWER_STEP times slower moves by less than ERROR_BOUND;
    then with one calibration at load for every deployment of a kind (`Run.shared_ms`)."""
    parts, shared = [], []
    for label, at in (("p50 TTFT", 0), ("p50 TPOT", 1)):
        checked = [r for rs in runs.values() for r in rs if r.p50_ms(at)[0]]
        errors = [(abs(_relative(r.p50_ms(at)[1], r.p50_ms(at)[0])), abs(r.sensitivity[at])) for r in checked]
        errors = [e for e in errors if not math.isnan(e[0])]  # a run the planner had no prediction for is left out
        if not errors:
            continue
        steady = [e for e, m in errors if m < ERROR_BOUND]  # nan (not measured) is not steady
        parts.append(f"{label} within {ERROR_BOUND:.0%} in {_within([e for e, _ in errors])}, and in {_within(steady)} "
                     f"where a {SLOWER_STEP - 1:.0%} slower machine moves the prediction by under {ERROR_BOUND:.0%}")
        once = [abs(_relative(r.shared_ms[at], r.p50_ms(at)[0])) for r in checked if not math.isnan(r.shared_ms[at])]
        if once:
            shared.append(f"{label} in {_within(once)}")
    if not parts:
        return "splits: no run to check the predictions against"
    return ("splits: predicted, each deployment calibrated at load on itself: " + "; ".join(parts)
            + ("; calibrated at load once per kind, on the first split and aggregated: " + ", ".join(shared) if shared else ""))


def _within(errors: list[float]) -> str:
    if not errors:
        return "no run"
    return (f"{sum(e <= ERROR_BOUND for e in errors)} of {len(errors)} runs "
            f"(median error {float(np.median(errors)):.0%})")


def against_aggregated(runs: dict[str, list[Run]], goodput: dict[str, float | None], aggregated: str) -> str:
    """The best measured split beside aggregated serving on as many instances, run for run: goodput and p95 ITL,
    the figures by which disaggregation pays or not."""
    top = max(r.rate for rs in runs.values() for r in rs)
    splits = [name for name in runs if name != aggregated]
    best = max(splits, key=lambda name: (goodput[name] or 0.0, sum(r.attainment[0] for r in runs[name])))

    def rate(name: str) -> str:
        g = goodput[name]
        return "none" if g is None else f"{g:g} req/s" + (" (met at the highest rate run: at least)" if g == top else "")

    ratio = (f" ({goodput[best] / goodput[aggregated]:.2f}x)" if goodput[best] and goodput[aggregated] else "")
    itl = "; ".join(f"{d.rate:g} req/s {d.itl_p95_ms:.0f} / {g.itl_p95_ms:.0f} ms ({d.itl_p95_ms / g.itl_p95_ms:.2f}x)"
                    for d, g in zip(runs[best], runs[aggregated]) if d.itl_p95_ms > 0 and g.itl_p95_ms > 0)
    return (f"splits: at equal instances, {best} against {aggregated}: goodput {rate(best)} against {rate(aggregated)}"
            f"{ratio}; p95 ITL {itl or 'not measured'}")


def run_to_run(name: str, first: list[Run], again: list[Run]) -> str:
    """The same deployment's runs measured twice: how much each measured figure moved."""
    cells = []
    moved = {"p50 TTFT": [], "p50 TPOT": []}
    for a, b in zip(first, again):
        ttft, tpot = _relative(b.ttft_p50_ms[0], a.ttft_p50_ms[0]), _relative(b.tpot_p50_ms[0], a.tpot_p50_ms[0])
        moved["p50 TTFT"].append(abs(ttft))
        moved["p50 TPOT"].append(abs(tpot))
        cells.append(f"{a.rate:g} req/s: attainment {a.attainment[0]:.0%} then {b.attainment[0]:.0%}, p50 TTFT {a.ttft_p50_ms[0]:.0f} then "
                     f"{b.ttft_p50_ms[0]:.0f} ms ({ttft:+.0%}), p50 TPOT {a.tpot_p50_ms[0]:.0f} then {b.tpot_p50_ms[0]:.0f} ms ({tpot:+.0%})")
    worst = ", ".join(f"{label} up to {max(values):.0%}" for label, values in moved.items() if values)
    return f"splits: {name} measured first and again last: " + "; ".join(cells) + f". The same runs moved by {worst}"


RATES = 5


def rates_around(goodputs) -> list[float]:
    """RATES rates evenly spaced on a log scale from 0.6x the lowest predicted goodput to 1.5x the highest, to two
    significant figures: each deployment's capacity bracketed as this machine runs today (its speed has moved 2x
    from one day to the next, so fixed rates fell all above every deployment's capacity on one day, all below on
    another). Up to 1.5x: with 1.2x, two deployments predicted 1.56 and 1.75 req/s both met the SLOs at the top rate,
    2.1 req/s, and the runs could not tell them apart."""
    met = [g for g in goodputs if g > 0]
    if not met:
        raise SystemExit("error: --rates auto: the planner predicts that no deployment meets the SLOs at any rate; give --rates")
    lo, hi = 0.6 * min(met), 1.5 * max(met)
    return sorted({float(f"{r:.2g}") for r in np.geomspace(lo, hi, RATES)})


def sustained(workload_path: Path, top_rate: float, seconds: float, out: Path) -> tuple[Path, Workload]:
    """The runs' workload: as many requests as `seconds` at the top rate sends, so every run lasts `seconds`.
    The planner's goodput is the rate a deployment sustains (disagg.planner.plan simulates at least
    SIMULATED_SECONDS), while the workload's own cap (60 requests) ended a 4.2 req/s run after 14 s, a burst
    whose queues never built up."""
    return workload_variant(workload_path, out / "workloads", "runs", max_requests=math.ceil(top_rate * seconds))


def _cell(run: Run) -> str:
    return (f"{run.attainment[0]:.0%} / {run.attainment[1]:.0%}, "
            f"{run.ttft_p50_ms[0]:.0f} / {run.ttft_p50_ms[1]:.0f}, {run.tpot_p50_ms[0]:.0f} / {run.tpot_p50_ms[1]:.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest splits", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-bench.yaml"))
    p.add_argument("--workload", default="prefill-heavy", help="workload YAML or name in loadtest/workloads/")
    p.add_argument("--instances", type=int, default=3, help="engine instances to split (one process, one rank each)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--rates", default="auto", help=f"comma-separated request rates, or auto: {RATES} rates around the "
                   "deployments' predicted goodputs (from 0.6x the lowest to 1.5x the highest)")
    p.add_argument("--seconds", type=float, default=60.0, help="each run's duration")
    p.add_argument("--out", type=Path, help="output directory (default: results/splits-<timestamp>)")
    p.add_argument("--no-repeat", action="store_true", help="do not serve the first deployment's rates again at the end")
    p.add_argument("--stand-in", type=stand_in, metavar="STEP_MS,TOKEN_MS",
                   help="engines that stand in for GPUs: each step takes STEP_MS + TOKEN_MS per token, off the CPU")
    a = p.parse_args(argv)
    if a.instances < 2:
        raise SystemExit("error: --instances must be at least 2: one prefill and one decode instance")
    with skipped_compute(*a.stand_in) if a.stand_in else contextlib.nullcontext():
        return run(a)


def stand_in(text: str) -> tuple[float, float]:
    """--stand-in's STEP_MS,TOKEN_MS."""
    try:
        step_ms, token_ms = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected STEP_MS,TOKEN_MS, two numbers such as 20,1.5") from None
    if min(step_ms, token_ms) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a step cannot take less than no time: both at least 0")
    if not step_ms + token_ms:
        raise argparse.ArgumentTypeError(f"{text!r}: steps would take no time: STEP_MS or TOKEN_MS above 0")
    return step_ms, token_ms


def run(a: argparse.Namespace) -> int:
    base = workload_file(a.workload)
    out = a.out or Path("results") / f"splits-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(THREAD_ENV)
    workload_path, workload = length_variant(base, a.prompt_tokens, a.seconds, out)
    slo = Slo(workload.ttft_slo_ms, workload.tpot_slo_ms)
    specs = {prefill: split_spec(a.config, out, a.instances, prefill) for prefill in range(1, a.instances)}
    for spec in specs.values():
        check_fits(spec, workload)
        build(spec, log=lambda line: print(f"build: {line}", flush=True))
    first = specs[1]
    planner = Planner(profiles(first, again=True), limits_of(first), handoff(first), hosts(first, out / "front", engines_on_cpu=not a.stand_in),
                      orchestrators=orchestrators_of(first))
    probe = None if a.stand_in else SpeedProbe(first.engine_dir("decode"))  # a stand-in's steps sleep: their speed holds
    planner = calibrated(planner, first, workload_path, out / "calibration")
    first_deployment = {kind: str(deployment_of(first, kind)) for kind in ROLES}
    traffic = traffic_of(workload, None, a.prompt_tokens)
    deployments = [(Deployment(prefill=n, decode=a.instances - n), "disaggregated", spec) for n, spec in specs.items()]
    deployments.append((Deployment(aggregated=a.instances), "aggregated", first))
    predicted_goodput = {str(d): planner.goodput(d, traffic) for d, _, _ in deployments}
    rates = rates_around(predicted_goodput.values()) if a.rates == "auto" else sorted(float(r) for r in a.rates.split(","))
    runs_path, runs_workload = sustained(workload_path, max(rates), a.seconds, out)
    engines = f"GPU stand-ins stepping {a.stand_in[0]:g} ms + {a.stand_in[1]:g} ms per token" if a.stand_in else "computing"
    print(f"splits: {a.instances} engine instances ({engines}) on {len(os.sched_getaffinity(0))} cores; prompts of {a.prompt_tokens} tokens "
          f"at {', '.join(f'{r:g}' for r in rates)} req/s, {a.seconds:g} s each; SLO TTFT <= {slo.ttft_ms:g} ms, "
          f"TPOT <= {slo.tpot_ms:g} ms", flush=True)

    own_planners: dict[str, dict] = {}
    own_goodput = dict(predicted_goodput)  # each deployment's, calibrated on itself where it is

    def measured(deployment: Deployment, kind: str, spec: DeploymentSpec, again: bool = False) -> list[Run]:
        name, where = str(deployment), out / (deployment_dir(deployment) + ("-again" if again else ""))
        own = fitted_at_load(planner, spec, workload_path, where / "calibration", kind, deployment)
        if own is not planner:
            goodput = own.goodput(deployment, traffic)
            if not again:
                own_goodput[name] = goodput
            print(f"splits: {name} calibrated at load on itself: predicted goodput {goodput:.2f} req/s "
                  f"({predicted_goodput[name]:.2f} calibrated on {first_deployment[kind]})", flush=True)
        own_planners[name + (", again" if again else "")] = own.fitted()
        slower, found = own.slower(SLOWER_STEP), []
        before = probe.slowdown() if probe else 1.0
        for rate in rates:
            samples_path, _ = run_point(kind, rate, spec, str(runs_path), runs_workload, where)
            after = probe.slowdown() if probe else 1.0  # also the next run's reading before it: nothing runs in between
            slowdown, before = (before + after) / 2, after
            samples = read_samples([samples_path])
            stats = run_stats(samples, slo)
            pred = predicted_run(own, deployment, samples, traffic)
            moved = predicted_run(slower, deployment, samples, traffic)
            shared = pred if own is planner else predicted_run(planner, deployment, samples, traffic)
            run = Run(rate, (stats.ttft_ms["p50"] or 0.0, pred.ttft_p50_s * 1e3 if pred else float("nan")),
                      (stats.slo_attainment, pred.attainment if pred else 0.0),
                      (stats.tpot_ms["p50"] or 0.0, pred.tpot_p50_s * 1e3 if pred else float("nan")),
                      (_relative(moved.ttft_p50_s, pred.ttft_p50_s), _relative(moved.tpot_p50_s, pred.tpot_p50_s))
                      if pred else (float("nan"), float("nan")),
                      stats.itl_ms["p95"] or float("nan"), slowdown,
                      (shared.ttft_p50_s * 1e3, shared.tpot_p50_s * 1e3) if shared else (float("nan"), float("nan")))
            found.append(run)
            print(f"[{name} at {rate:g} req/s{', again' if again else ''}] {_cell(run)} (calibrated on {first_deployment[kind]}: "
                  f"{run.shared_ms[0]:.0f}, {run.shared_ms[1]:.0f}); an engine alone ran x{slowdown:.2f} as slow as when profiled", flush=True)
        return found

    runs = {str(d): measured(d, kind, spec) for d, kind, spec in deployments}
    repeated = deployments[0]
    again = None if a.no_repeat else measured(*repeated, again=True)
    measured_goodput = {name: highest_met_rate((r.rate, r.attainment[0]) for r in rs) for name, rs in runs.items()}
    print(f"\n{'deployment':<24} | {'goodput req/s meas | pred':>25} | per rate: attainment meas / pred, p50 TTFT ms meas / pred, p50 TPOT ms meas / pred")
    for name, rs in runs.items():
        cells = "; ".join(f"{r.rate:g}: {_cell(r)}" for r in rs)
        meas = measured_goodput[name]
        print(f"{name:<24} | {'-' if meas is None else f'{meas:g}':>11} | {own_goodput[name]:>11.2f} | {cells}")
    line = verdict(measured_goodput, own_goodput, predicted_goodput)
    pays = against_aggregated(runs, measured_goodput, str(deployments[-1][0]))
    errors = prediction_errors(runs)
    repeat = None if again is None else run_to_run(str(repeated[0]), runs[str(repeated[0])], again)
    for text in (line, pays, errors, repeat):
        if text:
            print(text, flush=True)
    (out / "splits.json").write_text(json.dumps({
        "instances": a.instances, "prompt_tokens": a.prompt_tokens, "slo": asdict(slo),
        "stand_in": None if a.stand_in is None else {"step_ms": a.stand_in[0], "token_ms": a.stand_in[1]},
        "runs": {name: [asdict(r) for r in rs] for name, rs in runs.items()},
        "again": None if again is None else {"deployment": str(repeated[0]), "runs": [asdict(r) for r in again]},
        "errors": errors, "run_to_run": repeat,
        "goodput": {"measured": measured_goodput, "predicted": own_goodput, "predicted_once_per_kind": predicted_goodput}, "verdict": line, "against_aggregated": pays,
        "planner": planner.fitted(), "deployment_planners": own_planners,
    }, indent=2))
    return 0
