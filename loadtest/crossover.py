"""`python -m loadtest crossover`: where disaggregation starts to pay, by prompt length and request rate.

    python -m loadtest crossover                                  # cpu-bench, prompts of 256/1024/1920 tokens
    python -m loadtest crossover --prompt-tokens 512,1920 --rates 0.25,0.5,1 --seconds 60

For each prompt length (prompts drawn from [0.9 x length, length] tokens) and each rate, the aggregated
deployment (chunked prefill: configs/cpu-bench.yaml) and the disaggregated one run in turn on the same
cores with the same seeded traffic, each on a fresh server (the load points of `python -m loadtest
compare`, whose equal-budget spec this uses). Prints one table, each figure aggregated | disaggregated |
ratio: p95 ITL, p50 TTFT, SLO attainment; then per prompt length the goodput (DistServe's: the highest
rate whose attainment is >= 90%, every lower one too) and where disaggregated wins or loses. Writes the
same as JSON to <out>/crossover.json, with each run's samples beside it. A benchmark: minutes per load point, not a test.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path


from disagg.cli import build
from loadtest.compare import DEPLOYMENTS, THREAD_ENV, check_fits, compare_spec, run_point
from loadtest.report import ATTAINMENT_TARGET, RunStats, Slo, goodput, run_stats
from loadtest.samples import read_samples
from loadtest.workload import Workload, load_workload, workload_file, workload_variant


@dataclass(frozen=True)
class Point:
    """One prompt length at one rate: both deployments' figures."""

    prompt_tokens: int
    rate: float
    aggregated: RunStats
    disaggregated: RunStats
    samples: dict[str, str]  # deployment -> its samples file, relative to crossover.json (`loadtest plan --check`)

    def ratio(self, figure: str, p: str) -> float | None:
        a, d = getattr(self.aggregated, figure)[p], getattr(self.disaggregated, figure)[p]
        return None if a is None or d is None or a == 0 else d / a


def length_variant(base: Path, prompt_tokens: int, seconds: float | None, out: Path) -> tuple[Path, Workload]:
    """The workload file with every prompt `prompt_tokens` long (within 10%), written under `out`."""
    changes = {"prompt_tokens": [{"weight": 1.0, "min": max(1, int(prompt_tokens * 0.9)), "max": prompt_tokens}]}
    return workload_variant(base, out / "workloads", str(prompt_tokens), **changes, **({"duration_s": seconds} if seconds else {}))


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def table(points: list[Point]) -> list[str]:
    lines = [f"{'prompt':>6} {'req/s':>5} | {'p95 ITL ms (agg | disagg | ratio)':^32} | {'p50 TTFT ms (agg | disagg | ratio)':^34} | "
             f"{'SLO attainment (agg | disagg)':^29}"]
    for p in points:
        a, d = p.aggregated, p.disaggregated
        lines.append(
            f"{p.prompt_tokens:>6} {p.rate:>5g} | {_f(a.itl_ms['p95']):>9} | {_f(d.itl_ms['p95']):>9} | {_f(p.ratio('itl_ms', 'p95'), 2):>6} | "
            f"{_f(a.ttft_ms['p50']):>9} | {_f(d.ttft_ms['p50']):>9} | {_f(p.ratio('ttft_ms', 'p50'), 2):>8} | "
            f"{a.slo_attainment:>12.0%} | {d.slo_attainment:>12.0%}"
        )
    return lines


def verdicts(points: list[Point]) -> tuple[list[str], dict[int, dict[str, float | None]]]:
    """Per prompt length: goodput of each deployment, and the rates where disaggregated's p95 ITL wins."""
    lines, goodputs = [], {}
    for length in dict.fromkeys(p.prompt_tokens for p in points):
        mine = [p for p in points if p.prompt_tokens == length]
        g = goodput([s for p in mine for s in (p.aggregated, p.disaggregated)], ATTAINMENT_TARGET)
        goodputs[length] = g
        wins = [p.rate for p in mine if (p.ratio("itl_ms", "p95") or 9) < 1]
        halves = [p.rate for p in mine if (p.ratio("itl_ms", "p95") or 9) <= 0.5]
        agg, dis = g.get("aggregated"), g.get("disaggregated")
        ratio = "-" if not agg or dis is None else f"{dis / agg:.2f}x"
        lines.append(
            f"{length} tokens: p95 ITL lower disaggregated at {_rates(wins)} of {_rates([p.rate for p in mine])} req/s "
            f"(<= 0.5x at {_rates(halves)}); goodput aggregated {_f(agg, 2)} vs disaggregated {_f(dis, 2)} req/s ({ratio})"
        )
    return lines, goodputs


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{r:g}" for r in rates) or "none"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest crossover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-bench.yaml"))
    p.add_argument("--workload", default="prefill-heavy", help="workload YAML or name in loadtest/workloads/")
    p.add_argument("--prompt-tokens", default="256,1024,1920", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--rates", help="comma-separated request rates (default: the workload's sweep_rates)")
    p.add_argument("--seconds", type=float, help="each load point's duration (default: the workload's)")
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO (default: the workload's)")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO (default: the workload's)")
    p.add_argument("--out", type=Path, help="output directory (default: results/crossover-<timestamp>)")
    a = p.parse_args(argv)

    base = workload_file(a.workload)
    workload = load_workload(base)
    rates = [float(r) for r in a.rates.split(",")] if a.rates else list(workload.sweep_rates or [workload.rate])
    lengths = [int(n) for n in a.prompt_tokens.split(",")]
    slo = Slo(a.slo_ttft_ms or workload.ttft_slo_ms, a.slo_tpot_ms or workload.tpot_slo_ms)
    out = a.out or Path("results") / f"crossover-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(THREAD_ENV)
    spec, budget = compare_spec(a.config, out)
    variants = [length_variant(base, n, a.seconds, out) for n in lengths]
    for _, w in variants:
        check_fits(spec, w)
    print(f"crossover: {budget}", flush=True)
    print(f"crossover: prompts of {', '.join(map(str, lengths))} tokens at {_rates(rates)} req/s (Poisson), "
          f"{variants[0][1].duration_s:g} s or {workload.max_requests} requests per point; "
          f"SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms", flush=True)
    build(spec, log=lambda line: print(f"build: {line}", flush=True))
    points = []
    for length, (path, w) in zip(lengths, variants):
        for rate in rates:
            stats, samples = {}, {}
            for deployment in DEPLOYMENTS:  # interleaved, so a drift in the machine's load hits both
                samples_path, _ = run_point(deployment, rate, spec, str(path), w, out / f"{length}tokens")
                stats[deployment] = run_stats(read_samples([samples_path]), slo)
                samples[deployment] = str(samples_path.relative_to(out))
            points.append(Point(length, rate, **stats, samples=samples))
            print("\n".join(table(points[-1:])[1:]), flush=True)
    lines, goodputs = verdicts(points)
    print("\n".join(["", *table(points), "", *lines]), flush=True)
    (out / "crossover.json").write_text(json.dumps({
        "budget": budget, "slo": asdict(slo), "points": [asdict(p) for p in points],
        "goodput": {str(k): v for k, v in goodputs.items()}, "verdicts": lines,
    }, indent=2))
    print(f"crossover: wrote {out / 'crossover.json'}", flush=True)
    return 0
