"""`python -m loadtest compare`: aggregated vs disaggregated on this machine, same cores, same traffic.

    python -m loadtest compare                          # full size: workload `mixed` at its sweep rates
    python -m loadtest compare --quick                  # a few seconds per deployment (tests, smoke)
    python -m loadtest compare --rates 1,2,4 --workload mixed --out results/compare

1. Build: build-engines for `--config` (default configs/cpu-tiny.yaml), with the aggregated role given as
   many engine instances as prefill and decode together, so both deployments run the same number of engine
   processes (equal CPU budget). The variant spec and its model repository go to <out>/; the committed
   model_repository/ is not touched.
2. Per load point (rate), each deployment in turn on the same cores: a fresh tritonserver with
   --model-control-mode=explicit loading only that deployment's models, every process with one BLAS/OpenMP
   thread; two warm-up requests; a headless Locust run (subprocess with an outer timeout) writing raw
   samples while the metrics endpoint is sampled every 0.5 s; the server stops.
3. Report (loadtest/report.py) into <out>/ and the ratios disagg/agg: p95 ITL, p50 TTFT, goodput.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime
from pathlib import Path

import yaml

from disagg.cli import build
from disagg.repository import ENGINE_MODELS, role_models
from disagg.serve.server import TritonServer
from disagg.spec import DeploymentSpec, load_spec
from loadtest.metrics_sampler import MetricsSampler, MetricsSeries
from loadtest.report import Slo, print_report, write_report
from loadtest.samples import read_samples
from loadtest.workload import Workload, load_workload

ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
DEPLOYMENTS = ("aggregated", "disaggregated")
# One BLAS/OpenMP thread per engine process: each deployment gets exactly its processes' worth of cores,
# and numpy's thread pools do not oversubscribe the shared cores differently in the two deployments.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
LOCUST_SLACK_S = 30.0  # Locust's --run-time beyond the workload's duration: in-flight streams finish or count as unfinished
WARMUP_PROMPTS = ("warm up the engine", "warm up the engine with a longer prompt " * 6)


def compare_spec(config: Path, out: Path) -> tuple[DeploymentSpec, str]:
    """The spec to serve: `config` with aggregated instances = prefill + decode instances, rendered
    into <out>/model_repository. Returns it and a sentence saying what the equal budget is."""
    raw = yaml.safe_load(config.read_text())
    roles = raw["roles"]
    missing = [r for r in ("prefill", "decode", "aggregated") if r not in roles]
    if missing:
        raise SystemExit(f"error: {config} has no role {missing[0]}: compare needs prefill, decode and aggregated")
    split = [roles[r].get("instances", 1) * roles[r].get("tp", 1) * roles[r].get("pp", 1) for r in ("prefill", "decode")]
    agg = roles["aggregated"]
    per_instance = agg.get("tp", 1) * agg.get("pp", 1)
    if sum(split) % per_instance:
        raise SystemExit(f"error: aggregated tp*pp={per_instance} does not divide the {sum(split)} prefill+decode engine ranks")
    agg["instances"] = sum(split) // per_instance
    raw["output"] = {**raw.get("output", {}), "model_repository": str(out / "model_repository")}
    path = out / "spec.yaml"
    path.write_text(f"# {config} for `python -m loadtest compare`: equal engine budget\n" + yaml.safe_dump(raw, sort_keys=False))
    budget = (f"equal CPU budget: aggregated = {agg['instances']} aggregated_engine instance(s) x tp*pp {per_instance} "
              f"= {sum(split)} engine rank(s); disaggregated = prefill {split[0]} + decode {split[1]} engine rank(s); "
              f"one process per instance, {', '.join(f'{k}={v}' for k, v in THREAD_ENV.items())} in each; "
              f"both deployments on the same cores, one at a time")
    return load_spec(path), budget


def deployment_models(spec: DeploymentSpec, deployment: str) -> tuple[str, list[str]]:
    """The public model of a deployment and every model to load for it (and only those)."""
    front = ["preprocessing", "postprocessing"]
    if deployment == "aggregated":
        return "aggregated", [*front, ENGINE_MODELS["aggregated"], "aggregated_orchestrator", "aggregated"]
    return "ensemble", [*front, *role_models(spec, "prefill"), *role_models(spec, "decode"), "disagg_orchestrator", "ensemble"]


def check_fits(spec: DeploymentSpec, workload: Workload) -> None:
    """Fails early when the workload's longest request would be rejected by the server's limits."""
    longest = workload.max_prompt_tokens  # counted as preprocessing counts, special tokens included
    limit = min(r.max_input_len for name, r in spec.roles.items() if name != "decode")
    out = max(b.max for b in workload.output_tokens)
    seq = min(r.max_seq_len for name, r in spec.roles.items() if name != "prefill")
    if longest > limit or longest + out > seq:
        raise SystemExit(f"error: workload {workload.name}: prompts up to {longest} tokens (special tokens included) "
                         f"and {out} new tokens do not fit max_input_len={limit} / max_seq_len={seq}")


def warm_up(server: TritonServer, model: str) -> None:
    """Two requests outside the measurement: first-call costs (imports, numpy buffers) are not load."""
    for prompt in WARMUP_PROMPTS:
        body = json.dumps({"text_input": prompt, "max_tokens": 4, "stream": True}).encode()
        req = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/generate_stream", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                text = resp.read().decode()
        except urllib.error.HTTPError as exc:  # a Triton error: its SSE body says why
            text = exc.read().decode()
        except OSError as exc:
            raise SystemExit(f"error: warm-up request to {model} failed: {exc}\n{server.log_excerpt()}") from None
        if '"error"' in text:
            raise SystemExit(f"error: warm-up request to {model} failed: {text.strip()}\n{server.log_excerpt()}")


def run_locust(server: TritonServer, model: str, workload_path: str, workload: Workload, rate: float | None,
               tokenizer: Path, out: Path, name: str, add_special_tokens: bool = True) -> Path:
    """One headless Locust run; returns its samples file. Locust's exit code 1 (some requests failed)
    is fine: the failures are in the samples; anything else is an error."""
    samples = out / "samples" / f"{name}.jsonl"
    samples.parent.mkdir(parents=True, exist_ok=True)
    samples.unlink(missing_ok=True)
    prefix = out / "locust" / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    run_time = workload.duration_s + LOCUST_SLACK_S
    users = workload.with_rate(rate).open_loop_users() if rate else workload.users
    cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
        "--host", f"http://{server.http_url}", "-u", str(users), "-r", str(users),
        "--run-time", f"{run_time:.0f}s", "--stop-timeout", "10", "--loglevel", "WARNING",
        "--csv", str(prefix), "--json-file", str(prefix), "--html", f"{prefix}.html",
        "--model", model, "--workload", workload_path, "--tokenizer", str(tokenizer),
        "--samples-out", str(samples), "--request-rate", str(rate or 0),
        "--add-special-tokens", "true" if add_special_tokens else "false",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=run_time + 60)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"error: Locust run {name} did not finish within {run_time + 60:.0f} s") from None
    (prefix.parent / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode not in (0, 1) or not samples.is_file():
        raise SystemExit(f"error: Locust run {name} exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return samples


def run_point(deployment: str, rate: float | None, spec: DeploymentSpec, workload_path: str, workload: Workload,
              out: Path) -> tuple[Path, MetricsSeries]:
    """One load point on a freshly started server (no state carried over from another run): warm-up,
    then Locust with the metrics sampler. Returns the samples file and the metrics series."""
    model, models = deployment_models(spec, deployment)
    name = f"{deployment}-{f'{rate:g}rps' if rate else f'{workload.users}users'}"
    log = out / f"server-{name}.log"
    extra = ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]
    started = time.monotonic()
    with TritonServer(spec.model_repository, extra_args=extra, log_path=log) as server:
        print(f"[{name}] tritonserver ready in {time.monotonic() - started:.1f} s (log {log})", flush=True)
        warm_up(server, model)
        sampler = MetricsSampler(server.metrics_url).start()
        t0 = time.monotonic()
        samples_path = run_locust(server, model, workload_path, workload, rate, spec.model.path / "tokenizer.json", out, name,
                                  spec.model.add_special_tokens)
        series = sampler.stop()
        if server.process.poll() is not None:
            raise SystemExit(f"error: tritonserver exited with code {server.process.returncode} during {name}; "
                             f"its log:\n{server.log_excerpt()}")
    samples = read_samples([samples_path])
    errors = Counter(s.error for s in samples if not s.ok)
    print(f"[{name}] {len(samples)} requests, {sum(errors.values())} errors, {time.monotonic() - t0:.1f} s", flush=True)
    for message, count in errors.most_common(3):
        print(f"[{name}]   {count} x {message[:300]}", flush=True)
    (out / "metrics").mkdir(exist_ok=True)
    (out / "metrics" / f"{name}.json").write_text(json.dumps(
        {"deployment": deployment, "rate": rate, "users": workload.users, **series.to_dict()}))
    return samples_path, series


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-tiny.yaml"),
                   help="deployment spec with prefill, decode and aggregated roles (paths relative to the cwd)")
    p.add_argument("--workload", help="workload YAML or name in loadtest/workloads/ (default: mixed; quick with --quick)")
    p.add_argument("--quick", action="store_true", help="a few seconds and a handful of requests per deployment")
    p.add_argument("--rates", help="comma-separated request rates (req/s) to sweep, for goodput "
                                   "(default: the workload's sweep_rates, else its own arrival)")
    p.add_argument("--slo-ttft-ms", type=float, help="TTFT SLO (default: the workload's)")
    p.add_argument("--slo-tpot-ms", type=float, help="TPOT SLO (default: the workload's)")
    p.add_argument("--out", type=Path, help="output directory (default: results/compare-<timestamp>)")
    p.add_argument("--only", choices=DEPLOYMENTS, action="append", help="run only this deployment")
    a = p.parse_args(argv)

    workload_path = a.workload or ("quick" if a.quick else "mixed")
    workload = load_workload(workload_path)
    if a.rates:
        rates: list[float | None] = [float(r) for r in a.rates.split(",")]
    elif workload.sweep_rates and not a.quick:
        rates = list(workload.sweep_rates)
    else:
        rates = [workload.rate]
    slo = Slo(a.slo_ttft_ms or workload.ttft_slo_ms, a.slo_tpot_ms or workload.tpot_slo_ms)
    out = a.out or Path("results") / f"compare-{datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(THREAD_ENV)  # inherited by tritonserver and its Python stubs

    spec, budget = compare_spec(a.config, out)
    check_fits(spec, workload)
    print(f"compare: {budget}", flush=True)
    loads = ", ".join(f"{r:g} req/s (Poisson)" if r else f"{workload.users} users (closed loop)" for r in rates)
    print(f"compare: workload {workload.name} (seed {workload.seed}): up to {workload.max_requests} requests or "
          f"{workload.duration_s:g} s per run at {loads}; SLO TTFT <= {slo.ttft_ms:g} ms, TPOT <= {slo.tpot_ms:g} ms",
          flush=True)
    build(spec, log=lambda line: print(f"build: {line}", flush=True))
    paths, metrics = [], {}
    for rate in rates:  # deployments interleaved per rate, so a drift in the machine's load hits both
        for deployment in a.only or DEPLOYMENTS:
            path, metrics[(deployment, rate, workload.users)] = run_point(deployment, rate, spec, workload_path, workload, out)
            paths.append(path)
    print_report(write_report(out, read_samples(paths), slo, metrics), metrics)
    return 0
