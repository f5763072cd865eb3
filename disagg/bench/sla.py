"""`python -m disagg.bench sla`: two classes of traffic over a fast and a slow decode pool, routed by
service class against the two usual baselines, side by side in one run.

The deployment: one prefill replica and two decode pools of one replica each, every one a `disagg-serve`
process on loopback ports announcing itself in a registry (disagg.triton.replicas), and a front
(ensemble, orchestrator) that finds them there with the pools' costs: `fast` (cost 4) and `slow`
(cost 1). The engines skip their forward pass (disagg.engine.no_compute) and each step takes
`step ms + token ms x tokens in the step` without using the CPU, as a GPU's step does, with the fast and
the slow pool given different figures: two GPU classes, on a machine whose two cores the front needs.
What is real is everything a request meets above the engine's arithmetic: the front, the handoff, the
scheduling, the routing, and the speeds the orchestrator measures for itself.

The workload, the same for each routing policy (a fresh front per policy, the same engine replicas):
- interactive: open loop, Poisson arrivals at `--interactive-rate`, its class's TTFT and TPOT targets;
- batch: `--batch-clients` closed-loop clients, each sending its next request when the last ends; the
  class has no targets, only throughput.
Requests sent in the first `--warmup` seconds are not counted (each front measures its pools' speeds
from nothing). Then, for `--seconds`, every request sent is counted to its end.

Per policy (`orchestrator.pool_routing`): service_class (the cheapest pool predicted to meet the
class, refusing when none is), least_loaded and round_robin (both ignore the class). Printed: per
class the requests sent, refused, failed, those that met their class (interactive: completed within
both targets, TTFT measured by the client from sending, TPOT as (last token - first token) / (tokens - 1);
batch: completed), TTFT and TPOT p50/p95, batch output tokens/s over the window, the goodput (requests
per second that met their class), how many decode hops each pool took and what they cost (hops x the
pool's cost). Attainment counts refused requests as missed.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import random
import secrets
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from disagg.engine.no_compute import stand_in_env
from disagg.engine.sampling import NO_END_ID
from tools.stream_client import build_inputs

POLICIES = ("service_class", "least_loaded", "round_robin")
PROMPT = "It was the best of times, it was the worst of times, it was the age of wisdom"
REFUSAL = "is predicted to meet"  # disagg.triton.sla's refusal
DRAIN_S = 60.0


@dataclass(frozen=True)
class Pool:
    """An engine replica's GPU stand-in: each step takes step_ms + token_ms per token it computes."""

    name: str
    role: str
    step_ms: float
    token_ms: float
    cost: float = 1.0

    def env(self) -> dict[str, str]:
        return stand_in_env(self.step_ms, self.token_ms)


@dataclass(frozen=True)
class Workload:
    seconds: float
    warmup_s: float
    interactive_rate: float
    interactive_tokens: int
    ttft_ms: float
    tpot_ms: float
    batch_clients: int
    batch_tokens: int


@dataclass
class Request:
    klass: str
    sent: float
    counted: bool
    stamps: list[float] = field(default_factory=list)  # when each response with tokens came
    counts: list[int] = field(default_factory=list)  # its tokens
    error: str = ""

    def tpot(self) -> float | None:
        tokens = sum(self.counts)
        return (self.stamps[-1] - self.stamps[0]) / (tokens - 1) if tokens > 1 and len(self.stamps) > 1 else None


@dataclass
class ClassFigures:
    sent: int
    completed: int
    met: int
    refused: int
    failed: int
    ttft_ms: tuple[float, float]  # p50, p95 of completed requests
    tpot_ms: tuple[float, float]
    tokens_per_s: float  # output tokens received in the window / window

    @property
    def attainment(self) -> float:
        return self.met / self.sent if self.sent else float("nan")


@dataclass
class PolicyRun:
    policy: str
    classes: dict[str, ClassFigures]
    goodput: float  # requests per second that met their class
    decode_hops: dict[str, int]  # pool -> decode requests it completed
    decode_cost: float  # those hops times their pool's cost
    first_error: str = ""


def figures(requests: list[Request], klass: str, targets: tuple[float | None, float | None], window: tuple[float, float]) -> ClassFigures:
    """What the counted requests of one class got; `targets` (TTFT s, TPOT s) decide which met it."""
    mine = [r for r in requests if r.klass == klass and r.counted]
    done = [r for r in mine if r.stamps and not r.error]
    ttft_target, tpot_target = targets

    def met(r: Request) -> bool:
        ttft, tpot = r.stamps[0] - r.sent, r.tpot()
        return (ttft_target is None or ttft <= ttft_target) and (tpot_target is None or tpot is None or tpot <= tpot_target)

    def pct(values: list[float]) -> tuple[float, float]:
        return (float(np.percentile(values, 50)) * 1e3, float(np.percentile(values, 95)) * 1e3) if values else (float("nan"),) * 2

    refused = sum(REFUSAL in r.error for r in mine)
    start, end = window
    in_window = sum(n for r in requests if r.klass == klass for s, n in zip(r.stamps, r.counts) if start <= s <= end)
    return ClassFigures(
        sent=len(mine), completed=len(done), met=sum(map(met, done)), refused=refused, failed=sum(bool(r.error) for r in mine) - refused,
        ttft_ms=pct([r.stamps[0] - r.sent for r in done]), tpot_ms=pct([t for r in done if (t := r.tpot()) is not None]),
        tokens_per_s=in_window / (end - start),
    )


class Traffic:
    """Both classes against the front's `ensemble`. Every request goes on a gRPC stream of its own (an
    error on a stream does not say whose request it ended): the interactive arrivals each from a thread
    of a pool, each batch client from its own thread, one request after the other."""

    def __init__(self, url: str, workload: Workload, seed: int = 0):
        self.url, self.w = url, workload
        self.rng = random.Random(seed)
        self.requests: list[Request] = []
        self._lock = threading.Lock()

    def run(self) -> tuple[list[Request], tuple[float, float]]:
        """Sends the workload; returns every request once all have ended, and the counted window."""
        start = time.perf_counter()
        self.count_from, self.until = start + self.w.warmup_s, start + self.w.warmup_s + self.w.seconds
        with ThreadPoolExecutor(max_workers=self.w.batch_clients + 128, thread_name_prefix="client") as pool:
            ended = [pool.submit(self._batch_client) for _ in range(self.w.batch_clients)]
            arrival = start
            while (arrival := arrival + self.rng.expovariate(self.w.interactive_rate)) < self.until:
                time.sleep(max(0.0, arrival - time.perf_counter()))
                ended.append(pool.submit(self._request, "interactive"))
            for future in ended:
                future.result()  # raises what a client met
        return list(self.requests), (self.count_from, self.until)

    def _batch_client(self) -> None:
        while time.perf_counter() < self.until:
            self._request("batch")

    def _request(self, klass: str) -> None:
        """Sends one request on a stream of its own and returns once it has ended."""
        ended = threading.Event()
        client = grpcclient.InferenceServerClient(self.url)
        try:
            now = time.perf_counter()
            request = Request(klass, now, counted=self.count_from <= now < self.until)
            with self._lock:
                self.requests.append(request)
            client.start_stream(callback=functools.partial(self._on_response, request, ended))
            tokens = self.w.interactive_tokens if klass == "interactive" else self.w.batch_tokens
            client.async_stream_infer("ensemble", build_inputs(PROMPT, tokens, end_id=NO_END_ID, service_class=klass),
                                      enable_empty_final_response=True)
            if not ended.wait(DRAIN_S + self.w.seconds):
                raise RuntimeError(f"a {klass} request had not ended after {DRAIN_S + self.w.seconds:.0f} s")
        finally:
            client.stop_stream()
            client.close()

    @staticmethod
    def _on_response(request: Request, ended: threading.Event, result, error) -> None:
        now = time.perf_counter()
        if error is not None:
            request.error = error.message()
            ended.set()
            return
        counts = result.as_numpy("num_output_tokens")
        tokens = 0 if counts is None else int(counts.sum())
        if tokens:
            request.stamps.append(now)
            request.counts.append(tokens)
        if result.get_response().parameters["triton_final_response"].bool_param:
            ended.set()


def specs(config: Path, out: Path, w: Workload):
    """The engines' spec (cpu-tiny with room for the traffic) and one front spec per policy, the same but
    for `orchestrator.pool_routing`, each rendered beside the engines' repository."""
    from disagg.bench.front import front_spec

    streams = w.batch_clients + max(8, int(w.interactive_rate * 10))
    base = front_spec(config, out, streams)
    classes = (("interactive", w.ttft_ms, w.tpot_ms), ("batch", None, None))
    fronts = {
        policy: dataclasses.replace(base, orchestrator=dataclasses.replace(
            base.orchestrator, service_classes=classes, default_service_class="batch", pool_routing=policy))
        for policy in POLICIES
    }
    return base, fronts


def measure(config: Path, out: Path, w: Workload, pools: list[Pool], policies: tuple[str, ...] = POLICIES, log=print) -> list[PolicyRun]:
    from disagg.cli import build
    from disagg.render import render_repository
    from disagg.serve.process import Served
    from disagg.triton.credential import INTERNAL_KEY_ENV

    base, fronts = specs(config, out, w)
    build(base, log=lambda _msg: None)
    repositories = {}
    for policy, spec in fronts.items():
        repositories[policy] = Path(spec.model_repository).with_name(f"model_repository_{policy}")
        render_repository(spec, repositories[policy])
    runs = []
    with tempfile.TemporaryDirectory(prefix="disagg-bench-sla-") as scratch:
        root = Path(scratch)
        key = {INTERNAL_KEY_ENV: secrets.token_hex(16)}

        def serve(name: str, repository: Path, *flags: str, env: dict[str, str]) -> Served:
            (root / f"board-{name}").mkdir()
            return Served(name, repository, {**key, "DISAGG_LOAD_BOARD": str(root / f"board-{name}"), **env}, *flags)

        started = []
        try:
            for pool in pools:
                started.append(serve(pool.name, Path(base.model_repository), f"--load-model={pool.role}",
                                     f"--announce={root / pool.name}", env=pool.env()))
            for served in started:
                served.ready()
            by_role = {role: "|".join(f"registry:{root / p.name};cost={p.cost:g}" for p in pools if p.role == role) for role in ("prefill", "decode")}
            urls = ",".join(f"{role}={value}" for role, value in by_role.items())
            decoders = {p.name: s for p, s in zip(pools, started) if p.role == "decode"}
            models = [f"--load-model={m}" for m in ("preprocessing", "disagg_orchestrator", "postprocessing", "ensemble")]
            for policy in policies:
                front = serve(f"front-{policy}", repositories[policy], *models, env={"DISAGG_ENGINE_URLS": urls})
                try:
                    front.ready()
                    hops_before = {name: s.inferences("decode") for name, s in decoders.items()}
                    requests, window = Traffic(front.url, w).run()
                finally:
                    front.stop()
                targets = {"interactive": (w.ttft_ms / 1e3, w.tpot_ms / 1e3), "batch": (None, None)}
                classes = {k: figures(requests, k, t, window) for k, t in targets.items()}
                run = PolicyRun(
                    policy, classes, goodput=sum(c.met for c in classes.values()) / w.seconds,
                    decode_hops=(hops := {name: s.inferences("decode") - hops_before[name] for name, s in decoders.items()}),
                    decode_cost=sum(hops[p.name] * p.cost for p in pools if p.name in hops),
                    first_error=next((r.error for r in requests if r.error and REFUSAL not in r.error), ""),
                )
                runs.append(run)
                log(row(run))
        finally:
            for served in reversed(started):
                served.stop()
    return runs


HEADER = (f"  {'policy':<14}| {'interactive: sent':>17}{'met':>5}{'attain':>8}{'refused':>8}{'failed':>7}{'TTFT p50/p95':>14}{'TPOT p50/p95':>14} "
          f"| {'batch: done':>11}{'tok/s':>7}{'TPOT p50/p95':>14} | {'goodput':>8} | decode hops (cost)")


def row(run: PolicyRun) -> str:
    i, b = run.classes["interactive"], run.classes["batch"]
    pair = (lambda p: f"{p[0]:.0f}/{p[1]:.0f}")
    hops = ", ".join(f"{name} {n}" for name, n in run.decode_hops.items())
    return (f"  {run.policy:<14}| {i.sent:>17}{i.met:>5}{i.attainment:>8.1%}{i.refused:>8}{i.failed:>7}{pair(i.ttft_ms):>14}{pair(i.tpot_ms):>14} "
            f"| {b.completed:>11}{b.tokens_per_s:>7.0f}{pair(b.tpot_ms):>14} | {run.goodput:>6.2f}/s | {hops} ({run.decode_cost:g})"
            + (f"\n    first error: {run.first_error}" if run.first_error else ""))


def verdict(runs: list[PolicyRun]) -> list[str]:
    """The issue's two figures for SLA routing against each baseline."""
    by = {r.policy: r for r in runs}
    sla = by["service_class"]
    lines = [f"  service_class: interactive attainment {sla.classes['interactive'].attainment:.1%} (target >= 95%)"]
    for base in (b for b in ("round_robin", "least_loaded") if b in by):
        other = by[base]
        ratio = sla.classes["batch"].tokens_per_s / other.classes["batch"].tokens_per_s if other.classes["batch"].tokens_per_s else float("nan")
        lines.append(f"  vs {base}: batch tokens/s {ratio:.2f}x" + (" (target >= 0.90x)" if base == "round_robin" else "")
                     + f", interactive attainment {sla.classes['interactive'].attainment:.1%} vs {other.classes['interactive'].attainment:.1%}, "
                     f"goodput {sla.goodput:.2f} vs {other.goodput:.2f} requests/s, decode cost {sla.decode_cost:g} vs {other.decode_cost:g}")
    return lines


def plot(runs: list[PolicyRun], path: Path) -> Path | None:
    """Attainment per class and batch tokens/s per policy, as bars."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    x = np.arange(len(runs))
    left.bar(x, [r.classes["interactive"].attainment * 100 for r in runs], color="tab:blue")
    left.axhline(95, color="grey", linestyle="--", linewidth=1)
    left.set(title="interactive: SLO attainment (%)", xticks=x, xticklabels=[r.policy for r in runs], ylim=(0, 105))
    right.bar(x, [r.classes["batch"].tokens_per_s for r in runs], color="tab:orange")
    right.set(title="batch: output tokens/s", xticks=x, xticklabels=[r.policy for r in runs])
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench sla", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-tiny.yaml"))
    p.add_argument("--out", type=Path, default=Path("build/sla-bench"))
    p.add_argument("--seconds", type=float, default=30.0, help="counted window per policy")
    p.add_argument("--warmup", type=float, default=6.0, help="seconds of traffic per policy before the window")
    p.add_argument("--interactive-rate", type=float, default=2.0, help="interactive requests per second (Poisson)")
    p.add_argument("--interactive-tokens", type=int, default=32)
    p.add_argument("--ttft-ms", type=float, default=500.0, help="the interactive class's TTFT target")
    p.add_argument("--tpot-ms", type=float, default=100.0, help="the interactive class's TPOT target")
    p.add_argument("--batch-clients", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=64)
    p.add_argument("--fast", default="50,2", help="the fast decode pool's step ms,token ms")
    p.add_argument("--slow", default="120,6", help="the slow decode pool's step ms,token ms")
    p.add_argument("--prefill", default="20,0.1", help="the prefill replica's step ms,token ms")
    p.add_argument("--policies", default=",".join(POLICIES), help="routing policies to run, comma-separated")
    args = p.parse_args(argv)
    w = Workload(args.seconds, args.warmup, args.interactive_rate, args.interactive_tokens, args.ttft_ms, args.tpot_ms,
                 args.batch_clients, args.batch_tokens)
    step = (lambda v: tuple(float(x) for x in v.split(",")))
    pools = [Pool("prefill", "prefill", *step(args.prefill)), Pool("fast", "decode", *step(args.fast), cost=4),
             Pool("slow", "decode", *step(args.slow), cost=1)]
    print("service-class routing vs baselines; engines skip compute, a step takes step ms + token ms x tokens:")
    for pool in pools:
        print(f"  {pool.name:<8}{pool.role:<8}{pool.step_ms:g} ms + {pool.token_ms:g} ms/token, cost {pool.cost:g}")
    print(f"  interactive: {w.interactive_rate:g}/s Poisson, {w.interactive_tokens} tokens, TTFT <= {w.ttft_ms:g} ms, TPOT <= {w.tpot_ms:g} ms; "
          f"batch: {w.batch_clients} closed-loop clients, {w.batch_tokens} tokens, no targets; {w.warmup_s:g} s warm-up, {w.seconds:g} s counted")
    print(HEADER)
    runs = measure(args.config, args.out, w, pools, tuple(args.policies.split(",")))
    for line in verdict(runs):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sla.json").write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    drawn = plot(runs, args.out / "sla.png")
    print(f"  figures: {args.out / 'sla.json'}" + (f", plot: {drawn}" if drawn else ""))
    return 0
