"""Aggregated vs disaggregated, from raw samples: exact percentiles, SLO attainment, goodput, plots.

    python -m loadtest report results/run/samples/*.jsonl --out results/run --slo-ttft-ms 500 --slo-tpot-ms 50 \\
        [--metrics results/run/metrics/*.json]

One run = the samples of one deployment at one load point (a target request rate, or a closed loop of
N users). Percentiles are numpy's (linear interpolation) over the raw values, not Locust's buckets.
Writes report.json, report.csv, latency_cdf.png, itl_over_time.png, slo_attainment_vs_rate.png (when a
deployment was run at two or more rates) and metrics_<deployment>.png (when metrics were sampled).
"""
from __future__ import annotations

import argparse
import csv
import json
import textwrap
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from disagg.planner.plan import ATTAINMENT_TARGET  # goodput's share of requests within both SLOs: the planner's too
from loadtest.metrics_sampler import MetricsSeries
from loadtest.samples import Sample, read_samples

DEFINITIONS = {
    "TTFT": "request sent -> first streamed response that carries a token (num_output_tokens > 0), per request",
    "TPOT": "(E2E - TTFT) / (N_out - 1), per request with N_out >= 2",
    "ITL": "gap between consecutive streamed responses that carry tokens, per response, all requests pooled",
    "E2E": "request sent -> end of the stream, per request",
    "N_out": "tokens a request received (its responses' num_output_tokens summed)",
    "duration": "first send -> last stream end of the run",
    "output tokens/s": "sum of N_out / duration",
    "requests/s": "requests completed without error / duration",
    "SLO attainment": "fraction of all requests (errors and requests without a token count as misses) with "
                      "TTFT <= TTFT SLO and TPOT <= TPOT SLO (N_out = 1: TTFT only)",
    "request goodput": "requests meeting both SLOs / duration, for one run (req/s)",
    "goodput (DistServe)": "highest target request rate of a sweep at which SLO attainment >= 90%, "
                           "every lower tested rate also meeting it (req/s)",
    "send lag": "open loop: how late requests left against their Poisson schedule (p95)",
    "Triton metrics": "scraped from the metrics port every 0.5 s; per role, its instances summed; KV handoff = "
                      "bytes decode pulled from prefill",
}
ORDER = ("aggregated", "disaggregated")
COLORS = {"aggregated": "tab:orange", "disaggregated": "tab:blue"}


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def met(self, s: Sample) -> bool:
        if not s.ok or s.ttft is None or s.ttft * 1e3 > self.ttft_ms:
            return False
        return s.tpot is None or s.tpot * 1e3 <= self.tpot_ms


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    """p50/p95/p99 and mean, in ms, of values in seconds (None when there are none)."""
    if not seconds:
        return {"p50": None, "p95": None, "p99": None, "mean": None}
    ms = np.asarray(seconds, dtype=float) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99), "mean": float(ms.mean())}


RunKey = tuple[str, float | None, int]  # deployment, target rate (None: closed loop), users


@dataclass(frozen=True)
class RunStats:
    deployment: str
    rate: float | None
    users: int
    requests: int
    errors: int
    no_text: int  # completed without error but without a token (no token arrival to time)
    duration_s: float
    ttft_ms: dict
    tpot_ms: dict
    itl_ms: dict
    e2e_ms: dict
    output_tokens_per_s: float
    requests_per_s: float
    slo_attainment: float
    request_goodput: float
    send_lag_p95_ms: float | None

    @property
    def key(self) -> RunKey:
        return self.deployment, self.rate, self.users

    @property
    def load(self) -> str:
        return f"{self.rate:g} req/s (Poisson, up to {self.users} users)" if self.rate else f"{self.users} users (closed loop)"


def run_key(s: Sample) -> RunKey:
    return s.deployment, s.rate, s.users


def run_stats(samples: list[Sample], slo: Slo) -> RunStats:
    """The numbers of one run; `samples` all share one run_key."""
    start = min(s.t_send for s in samples)
    duration = max(s.t_end for s in samples) - start
    ok = [s for s in samples if s.ok]
    met = sum(slo.met(s) for s in samples)
    lags = [s.t_send - start - s.scheduled for s in samples if s.scheduled is not None]
    deployment, rate, users = run_key(samples[0])
    return RunStats(
        deployment=deployment, rate=rate, users=users, requests=len(samples),
        errors=len(samples) - len(ok), no_text=sum(s.n_out == 0 for s in ok), duration_s=duration,
        ttft_ms=percentiles([s.ttft for s in ok if s.ttft is not None]),
        tpot_ms=percentiles([s.tpot for s in ok if s.tpot is not None]),
        itl_ms=percentiles([gap for s in ok for gap in s.itl]),
        e2e_ms=percentiles([s.e2e for s in ok]),
        output_tokens_per_s=sum(s.n_out for s in ok) / duration,
        requests_per_s=len(ok) / duration,
        slo_attainment=met / len(samples),
        request_goodput=met / duration,
        send_lag_p95_ms=float(np.percentile(lags, 95) * 1e3) if lags else None,
    )


def group_runs(samples: list[Sample]) -> dict[RunKey, list[Sample]]:
    """Samples per run, ordered aggregated first, then by rate."""
    runs: dict[RunKey, list[Sample]] = {}
    for s in samples:
        runs.setdefault(run_key(s), []).append(s)
    order = {d: i for i, d in enumerate(ORDER)}
    return dict(sorted(runs.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1] or 0.0, kv[0][2])))


def highest_met_rate(attainment_by_rate: Iterable[tuple[float, float]], target: float = ATTAINMENT_TARGET) -> float | None:
    """DistServe goodput over (rate, attainment) runs: the highest rate before the first (ascending) rate
    whose attainment is below `target`; None when even the lowest rate misses it."""
    best = None
    for rate, attainment in sorted(attainment_by_rate):
        if attainment < target:
            break
        best = rate
    return best


def goodput(stats: list[RunStats], target: float = ATTAINMENT_TARGET) -> dict[str, float | None]:
    """`highest_met_rate` per deployment over its open-loop runs."""
    return {deployment: highest_met_rate(((r.rate, r.slo_attainment) for r in stats if r.deployment == deployment and r.rate), target)
            for deployment in dict.fromkeys(r.deployment for r in stats if r.rate)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _load_points(stats: list[RunStats]) -> dict[tuple, dict[str, RunStats]]:
    points: dict[tuple, dict[str, RunStats]] = {}
    for r in stats:
        points.setdefault((r.rate, r.users), {})[r.deployment] = r
    return points


ROWS = [(f"{m} {p} (ms)", lambda r, m=m, p=p: getattr(r, f"{m.lower()}_ms")[p], 1)
        for m in ("TTFT", "TPOT", "ITL") for p in ("p50", "p95", "p99")] + [
    ("E2E p50 (ms)", lambda r: r.e2e_ms["p50"], 1),
    ("E2E p95 (ms)", lambda r: r.e2e_ms["p95"], 1),
    ("output tokens/s", lambda r: r.output_tokens_per_s, 1),
    ("requests/s", lambda r: r.requests_per_s, 2),
    ("requests", lambda r: r.requests, 0),
    ("errors", lambda r: r.errors, 0),
    ("requests without a token", lambda r: r.no_text, 0),
    ("SLO attainment", lambda r: r.slo_attainment, 3),
    ("request goodput (req/s)", lambda r: r.request_goodput, 2),
    ("send lag p95 (ms)", lambda r: r.send_lag_p95_ms, 1),
]


def format_table(stats: list[RunStats]) -> str:
    """Side by side per load point: one column per deployment, then disagg/agg."""
    blocks = []
    for runs in _load_points(stats).values():
        deployments = [d for d in ORDER if d in runs] + [d for d in runs if d not in ORDER]
        both = all(d in runs for d in ORDER)
        header = ["", *deployments] + (["disagg/agg"] if both else [])
        rows = [header]
        for name, get, digits in ROWS:
            values = [get(runs[d]) for d in deployments]
            row = [name, *(_fmt(v, digits) for v in values)]
            if both:
                row.append(_fmt(_ratio(get(runs["disaggregated"]), get(runs["aggregated"])), 2))
            rows.append(row)
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows]
        blocks.append(f"load: {next(iter(runs.values())).load}\n" + "\n".join(lines))
    return "\n\n".join(blocks)


def headline(stats: list[RunStats], slo: Slo) -> list[str]:
    """The disagg/agg ratios: p95 ITL and p50 TTFT at each load point, then goodput."""
    lines = []
    for runs in _load_points(stats).values():
        if not all(d in runs for d in ORDER):
            continue
        agg, dis = runs["aggregated"], runs["disaggregated"]
        lines.append(
            f"{agg.load}: disagg/agg p95 ITL {_fmt(_ratio(dis.itl_ms['p95'], agg.itl_ms['p95']), 2)}x "
            f"({_fmt(dis.itl_ms['p95'])} vs {_fmt(agg.itl_ms['p95'])} ms), "
            f"p50 TTFT {_fmt(_ratio(dis.ttft_ms['p50'], agg.ttft_ms['p50']), 2)}x "
            f"({_fmt(dis.ttft_ms['p50'])} vs {_fmt(agg.ttft_ms['p50'])} ms), "
            f"request goodput {_fmt(_ratio(dis.request_goodput, agg.request_goodput), 2)}x "
            f"({dis.request_goodput:.2f} vs {agg.request_goodput:.2f} req/s)"
        )
    rated = {r.rate for r in stats if r.rate}
    if len(rated) >= 2:
        g = goodput(stats)
        agg, dis = g.get("aggregated"), g.get("disaggregated")
        lines.append(
            f"goodput (DistServe, SLO TTFT <= {slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms for >= 90% of requests, "
            f"rates {', '.join(f'{r:g}' for r in sorted(rated))} req/s): disaggregated {_fmt(dis, 2)} vs aggregated "
            f"{_fmt(agg, 2)} req/s -> disagg/agg {_fmt(_ratio(dis, agg), 2)}x"
            + ("" if agg is not None else " (aggregated met the SLOs at no tested rate)")
        )
    return lines


# --- plots -----------------------------------------------------------------------------------------


def _figure(*args, **kwargs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def _log_axis(ax, which: str) -> None:
    """Log scale on axis `which` ("x"/"y") of plotted data, labelled as plain numbers: 1, 2, 5, 10, ...
    over up to three decades, else 1, 10, 100, ..."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    getattr(ax, f"set_{which}scale")("log")
    lo, hi = getattr(ax, f"get_{which}lim")()
    axis = getattr(ax, f"{which}axis")
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if hi / lo <= 1e3 else (1.0,)))
    axis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _save(fig, path: Path, definitions: list[str]) -> Path:
    """Writes the figure with the definitions of what it plots printed under it."""
    width = int(fig.get_figwidth() * 17)  # characters of 7-pt text per line
    lines = [line for k in definitions for line in textwrap.wrap(f"{k}: {DEFINITIONS[k]}", width)]
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=7, va="bottom")
    fig.tight_layout(rect=(0, (0.3 + 0.13 * len(lines)) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _label(key: RunKey) -> str:
    deployment, rate, users = key
    return f"{deployment} @ {rate:g} req/s" if rate else f"{deployment}, {users} users"


def plot_cdfs(runs: dict[RunKey, list[Sample]], path: Path) -> Path:
    fig, axes = _figure(1, 3, figsize=(15, 4.8))
    metrics = {"TTFT": lambda s: [s.ttft], "TPOT": lambda s: [s.tpot], "ITL": lambda s: s.itl}
    rates = sorted({k[1] or 0.0 for k in runs})
    for ax, (name, get) in zip(axes, metrics.items()):
        for key, samples in runs.items():
            values = np.sort([v * 1e3 for s in samples if s.ok for v in get(s) if v is not None])
            if len(values):
                alpha = 0.35 + 0.65 * (rates.index(key[1] or 0.0) + 1) / len(rates)
                ax.plot(values, np.arange(1, len(values) + 1) / len(values), label=_label(key),
                        color=COLORS.get(key[0]), alpha=alpha)
        ax.set(title=f"{name} CDF", xlabel=f"{name} (ms, log scale)", ylabel="fraction of values", ylim=(0, 1.01))
        _log_axis(ax, "x")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Latency CDFs of the requests completed without error")
    return _save(fig, path, ["TTFT", "TPOT", "ITL"])


def plot_itl_over_time(runs: dict[RunKey, list[Sample]], path: Path) -> Path:
    deployments = list(dict.fromkeys(k[0] for k in runs))
    fig, axes = _figure(len(deployments), 1, figsize=(12, 3.2 * len(deployments)), squeeze=False, sharey=True)
    for ax, deployment in zip(axes[:, 0], deployments):
        for key, samples in runs.items():
            if key[0] != deployment:
                continue
            start = min(s.t_send for s in samples)
            points = [(b - start, (b - a) * 1e3) for s in samples if s.ok for a, b in zip(s.token_times, s.token_times[1:])]
            if points:
                x, y = zip(*points)
                ax.scatter(x, y, s=3, alpha=0.5, label=_label(key))
        ax.set(title=f"ITL over time: {deployment}", xlabel="time since the run's first send (s), at the later chunk",
               ylabel="ITL (ms, log scale)")
        _log_axis(ax, "y")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, markerscale=3)
    return _save(fig, path, ["ITL"])


def plot_attainment(stats: list[RunStats], slo: Slo, path: Path) -> Path:
    fig, ax = _figure(figsize=(7, 4.5))
    for deployment, best in goodput(stats).items():
        runs = sorted((r for r in stats if r.deployment == deployment and r.rate), key=lambda r: r.rate)
        ax.plot([r.rate for r in runs], [r.slo_attainment for r in runs], "o-", color=COLORS.get(deployment),
                label=f"{deployment} (goodput {_fmt(best, 2)} req/s)")
        if best is not None:
            ax.axvline(best, color=COLORS.get(deployment), ls=":", alpha=0.7)
    ax.axhline(ATTAINMENT_TARGET, color="gray", ls="--", label="90% target")
    ax.set(title=f"SLO attainment vs request rate (TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms)",
           xlabel="target request rate (req/s, Poisson)", ylabel="SLO attainment", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path, ["SLO attainment", "goodput (DistServe)"])


METRIC_PANELS = (
    ("disagg_kv_blocks_in_use", "KV blocks in use"),
    ("disagg_queue_depth", "queue depth"),
    ("disagg_requests_in_flight", "engine requests in flight"),
    ("disagg_kv_handoff_bytes_total", "KV handoff MB (cumulative in run)"),
)


def plot_metrics(deployment: str, runs: list[tuple[RunKey, MetricsSeries, float]], path: Path) -> Path:
    """One column per run of `deployment`, one row per metric; lines per role (instances summed)."""
    fig, axes = _figure(len(METRIC_PANELS), len(runs), figsize=(max(8.0, 4.5 * len(runs)), 10), squeeze=False, sharex="col")
    for col, (key, series, start) in enumerate(runs):
        t = [x - start for x in series.t]
        for row, (metric, title) in enumerate(METRIC_PANELS):
            ax = axes[row, col]
            for role, values in sorted(series.role_values(metric).items()):
                if metric.endswith("_bytes_total"):
                    values = [(v - values[0]) / 1e6 for v in values]
                ax.plot(t, values, label=role)
            ax.set_title(f"{title}\n{_label(key)}", fontsize=9)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        axes[-1, col].set_xlabel("time since the run's first send (s)")
    fig.suptitle(f"Triton metrics during the load test: {deployment}\n(per role, each role's instances summed)")
    return _save(fig, path, ["Triton metrics"])


# --- report ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    slo: Slo
    stats: list[RunStats]
    goodput: dict[str, float | None]
    files: list[Path]


CSV_FIELDS = ["deployment", "rate", "users", "requests", "errors", "no_text", "duration_s", "output_tokens_per_s",
              "requests_per_s", "slo_attainment", "request_goodput", "send_lag_p95_ms"]


def write_report(out_dir: str | Path, samples: list[Sample], slo: Slo,
                 metrics: dict[RunKey, MetricsSeries] | None = None) -> Report:
    """Computes every run's numbers and writes report.json, report.csv and the PNGs into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs = group_runs(samples)
    stats = [run_stats(s, slo) for s in runs.values()]
    best = goodput(stats)
    metrics = metrics or {}
    (out / "report.json").write_text(json.dumps({
        "definitions": DEFINITIONS,
        "slo": asdict(slo),
        "goodput_distserve": best,
        "runs": [{**asdict(r), "metrics": metrics[r.key].to_dict() if r.key in metrics else None} for r in stats],
    }, indent=1))
    with open(out / "report.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(CSV_FIELDS + [f"{m}_{p}_ms" for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p95", "p99", "mean")])
        for r in stats:
            row = asdict(r)
            writer.writerow([row[k] for k in CSV_FIELDS] + [row[f"{m}_ms"][p] for m in ("ttft", "tpot", "itl", "e2e") for p in ("p50", "p95", "p99", "mean")])
    files = [out / "report.json", out / "report.csv", plot_cdfs(runs, out / "latency_cdf.png"),
             plot_itl_over_time(runs, out / "itl_over_time.png")]
    if any(len({r.rate for r in stats if r.deployment == d and r.rate}) >= 2 for d in best):
        files.append(plot_attainment(stats, slo, out / "slo_attainment_vs_rate.png"))
    for deployment in dict.fromkeys(k[0] for k in runs):
        sampled = [(k, metrics[k], min(s.t_send for s in runs[k])) for k in runs if k[0] == deployment and k in metrics]
        if sampled:
            files.append(plot_metrics(deployment, sampled, out / f"metrics_{deployment}.png"))
    return Report(slo, stats, best, files)


def print_report(report: Report, metrics: dict[RunKey, MetricsSeries] | None = None) -> None:
    print(f"SLOs: TTFT <= {report.slo.ttft_ms:g} ms, TPOT <= {report.slo.tpot_ms:g} ms")
    print(format_table(report.stats))
    for run in report.stats:
        for line in (metrics or {}).get(run.key, MetricsSeries((), {})).summary_lines():
            print(f"[{_label(run.key)}] {line}")
    print("\n".join(headline(report.stats, report.slo)))
    print("definitions: " + "; ".join(f"{k} = {v}" for k, v in DEFINITIONS.items()))
    print("files: " + ", ".join(str(p) for p in report.files))


def load_metrics(paths: list[str | Path]) -> dict[RunKey, MetricsSeries]:
    """Metrics files as written by `compare`: {"deployment", "rate", "users", "t", "series", ...}."""
    out = {}
    for path in paths:
        raw = json.loads(Path(path).read_text())
        out[(raw["deployment"], raw["rate"], raw["users"])] = MetricsSeries.from_dict(raw)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("samples", nargs="+", help="JSONL sample files written by loadtest/locustfile.py")
    p.add_argument("--out", required=True, help="directory for report.json, report.csv and the PNGs")
    p.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT SLO (ms)")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="TPOT SLO (ms)")
    p.add_argument("--metrics", nargs="*", default=[], help="metrics JSON files written by compare")
    a = p.parse_args(argv)
    metrics = load_metrics(a.metrics)
    print_report(write_report(a.out, read_samples(a.samples), Slo(a.slo_ttft_ms, a.slo_tpot_ms), metrics), metrics)
    return 0
