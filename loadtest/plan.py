"""`python -m loadtest plan`: how many prefill and decode instances for a workload (disagg.planner).

    python -m loadtest plan                                   # cpu-bench, workload prefill-heavy, 2 instances
    python -m loadtest plan --instances 8 --rate 3
    python -m loadtest plan --check results/crossover-*/crossover.json    # predictions vs measured runs
    python -m loadtest plan --config configs/h200x8-intra-node.yaml --workload long-prompt-gpu \\
        --model-config configs/models/Llama-3.1-8B-Instruct.json --gpu H200    # GPUs: loadtest/plan_gpus.py

1. Builds `--config` and profiles each role's engine on this machine (timed steps, one BLAS thread, as
   the load tests serve: decode steps by batch size, steps with prompt tokens; disagg.planner.profile),
   cached in <build_dir>/planner-profile.json per engine.
   Then measures what the rest of a deployment costs per output token on this machine's CPU (the servers,
   the Python models around the engines, the client: `python -m disagg.bench front`'s driver with the
   engines' compute skipped, through `ensemble` and `aggregated`; not the engine models' own processes,
   whose work around their steps calibration covers), since here it shares the cores with the engines
   (disagg.planner.simulate.Host). `--no-host` leaves it out, as for engines on GPUs, and calibration.
   Then calibrates (loadtest.calibration): ten of the workload's requests, sent one at a time through each deployment: what
   they took beyond the simulation, TTFT becomes the deployment's latency and TPOT an overhead on every
   decode step; then a batch sent at once: what its TPOT took beyond that, a cost per generating sequence
   in every step; then, where the engines compute on this machine's cores, 60 requests at the predicted
   goodput: the factor on the decode work that their TPOT took, served again (at most twice, the median
   taken) where it is beyond x1.2 either way (`--no-calibration`: none of these).
   Every other deployment of `--instances` (each prefill:decode split, aggregated) then gets its own repository
   (<out>/deployments/) and that run at load on itself (`calibrated_each`), since which engines share the
   cores changes how much they slow each other: 60 requests at its predicted goodput, 1.5-2.5 minutes per
   deployment here (prefill-heavy).
2. Simulates every prefill:decode split of `--instances` (and decode batch limits up to the engine's)
   and the all-aggregated deployment under the workload, each with its own calibration
   (disagg.planner.simulate); prints each one's
   goodput (highest rate with >= 90% of requests within both SLOs) per instance and its predicted p50
   TTFT, p95 ITL and attainment at the workload's rate, then the recommendation.
3. `--check`: for each load point of `python -m loadtest crossover` runs, the requests that run sent
   (replayed from its samples: send times, prompt lengths, tokens received) simulated on the deployment
   that served them, printed beside the measured figures with the relative error.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import yaml

from disagg.cli import build
from disagg.engine import engine as engine_module
from disagg.engine.config import EngineConfig
from disagg.engine.no_compute import stand_in_key
from disagg.planner import profile as profile_module
from disagg.planner.plan import Option, Planner, Prediction, Traffic, deployments, predict, ranked
from disagg.planner.profile import StepModel, profile_engine
from disagg.planner.roofline import ACCELERATORS
from disagg.planner.simulate import Deployment, EngineLimits, Host, Orchestrators
from disagg.repository import role_models
from disagg.spec import DeploymentSpec
from loadtest import plan_gpus
from loadtest.calibration import ROLES, calibrated, calibrated_each, deployment_of, replayed, splittable, traffic_of
from loadtest.compare import THREAD_ENV, compare_spec
from loadtest.samples import Sample, read_samples
from loadtest.workload import Workload, load_workload, workload_file


def profiles(spec: DeploymentSpec, again: bool = False) -> dict[str, StepModel]:
    """Each role's StepModel, profiled once per built engine and way of profiling (keyed by the engine's
    config.json's mtime, the source of the profiler and of the reference engine it times, and the stand-in's
    step rule where the engines are GPU stand-ins). `again`: profiled now whatever is cached (and cached
    anew), for predictions checked against runs made now: this machine's speed moves from one hour to the
    next (a decode step cached at 14.2 ms took 15.9 ms alone two hours later)."""
    cache_path = spec.build_dir / "planner-profile.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    sources = [Path(profile_module.__file__), *sorted(Path(engine_module.__file__).parent.glob("*.py"))]
    profiler = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()[:12]
    stand_in = stand_in_key()
    stand_in = f" {stand_in}" if stand_in else ""
    out = {}
    for role in spec.roles:
        engine = spec.engine_dir(role)
        key = f"{engine.resolve()}@{(engine / 'config.json').stat().st_mtime_ns}#{profiler}{stand_in}"
        if again or key not in cache:
            print(f"plan: profiling the {role} engine ({engine})", flush=True)
            cache[key] = asdict(profile_engine(engine))
        out[role] = StepModel.from_dict(cache[key])
    cache_path.write_text(json.dumps(cache, indent=2))
    return out


FRONT_STREAMS = 4  # as many as the workloads' rates keep in flight here
FRONT_STEP_MS = 20.0  # an engine step as long as a decode step of bench-100mb here, without its CPU
FRONT_SECONDS = 5.0


def hosts(spec: DeploymentSpec, out: Path, engines_on_cpu: bool = True) -> dict[str, Host]:
    """Each kind of deployment on this machine's cores, with its front's CPU per output token; `engines_on_cpu`
    False where the engines are GPU stand-ins, whose steps leave the cores to the front."""
    from disagg.bench.corun import decode_interference
    from disagg.bench.front import measure

    print(f"plan: measuring the front's CPU per output token ({FRONT_STREAMS} streams, engines skipping compute)", flush=True)
    rows, _ = measure(spec.source, out, (FRONT_STREAMS,), FRONT_SECONDS, 64, FRONT_STEP_MS, paths=("ensemble", "aggregated"))
    cores = len(os.sched_getaffinity(0))
    per_token = {r.path: front_s_per_token(r.cpu_ms_per_token, spec) for r in rows}
    print(f"plan: the front costs {per_token['ensemble'] * 1e3:.2f} ms of CPU per output token through the ensemble, "
          f"{per_token['aggregated'] * 1e3:.2f} ms through the aggregated one", flush=True)
    interference = 0.0
    if engines_on_cpu:
        ratio, shared, interference = decode_interference(spec.engine_dir("decode"), cores)
        print(f"plan: decode steps beside two other decoding processes took x{ratio:.2f} as long as alone, where sharing "
              f"{cores} cores explains x{shared:.2f}: each other decoding engine slows a decode step by "
              f"{interference:.0%}", flush=True)
    return {kind: Host(cores, per_token[path], engines_on_cpu, interference)
            for kind, path in (("disaggregated", "ensemble"), ("aggregated", "aggregated"))}


def front_s_per_token(cpu_ms_per_token: dict[str, float], spec: DeploymentSpec) -> float:
    """The CPU per output token of every process but the stubs of the spec's engine models (`bench front`'s
    names: "stub <model>"). An engine's own work around its steps (the step loop, its responses) is in its calibrated
    steps, which scale the profile to the time requests took to serve; and the bench's server also runs,
    idle, the engines of the deployment it does not measure, whose polling is no cost of the front."""
    engines = {name for role in spec.roles for name in role_models(spec, role)}
    return sum(ms for name, ms in cpu_ms_per_token.items() if name.removeprefix("stub ") not in engines) / 1e3


def orchestrators_of(spec: DeploymentSpec) -> Orchestrators:
    return Orchestrators(spec.orchestrator.instances, spec.orchestrator.max_in_flight)


def limits_of(spec: DeploymentSpec) -> dict[str, EngineLimits]:
    return {name: EngineLimits(r.max_batch_size, r.max_num_tokens, r.enable_chunked_context, r.tokens_per_block)
            for name, r in spec.roles.items()}


def handoff(spec: DeploymentSpec):
    """Seconds to move a prompt's KV from prefill to decode: its bytes at this machine's memcpy speed."""
    per_token = EngineConfig.load(spec.engine_dir("decode")).model.kv_bytes_per_token
    a = np.ones(1 << 26, dtype=np.float32)
    b = np.empty_like(a)
    seconds = []
    for _ in range(3):  # the fastest of three: the first copy also faults in the destination's pages
        t = time.perf_counter()
        np.copyto(b, a)
        seconds.append(time.perf_counter() - t)
    bandwidth = a.nbytes / min(seconds)
    return lambda tokens: tokens * per_token / bandwidth


def print_plan(options: list[Option], instances: int, traffic: Traffic) -> None:
    print(f"{'deployment':<24} {'decode batch':>12} | {'goodput req/s':>13} {'per instance':>12} | "
          f"at {traffic.rate:g} req/s: {'p50 TTFT ms':>11} {'p95 ITL ms':>10} {'attainment':>10}")
    for o in options:
        p = o.at_rate
        print(f"{str(o.deployment):<24} {o.decode_batch or '-':>12} | {o.goodput:>13.2f} {o.per_instance:>12.3f} | "
              f"{'':>{len(f'at {traffic.rate:g} req/s: ')}}{p.ttft_p50_s * 1e3:>11.0f} {p.itl_p95_s * 1e3:>10.0f} {p.attainment:>10.0%}")
    best = options[0]
    agg = next((o for o in options if o.deployment.aggregated), None)
    print(f"plan: recommended {best.deployment}" + (f", decode max_batch_size {best.decode_batch}" if best.decode_batch else ""),
          flush=True)
    if agg is not None and best is not agg:
        ratio = best.goodput / agg.goodput if agg.goodput else float("inf")
        print(f"plan: aggregated x{instances} would serve {agg.goodput:.2f} req/s: the split gives {ratio:.2f}x its goodput"
              + (" (aggregated would do as well)" if ratio < 1.05 else ""))
    elif agg is not None:
        print("plan: aggregated serving does at least as well as any split for this workload")


def once_per_kind(planner: Planner, planners: dict[Deployment, Planner], calibrated_on: tuple[Deployment, ...],
                  traffic: Traffic) -> str | None:
    """What `planner`, calibrated on `calibrated_on` only, would predict and recommend, where some deployment has a
    planner of its own (`calibrated_each`): how much calibrating each candidate on itself changed."""
    if all(own is planner for own in planners.values()):
        return None
    once = {d: planner.goodput(d, traffic) for d in planners}
    return (f"plan: calibrated once per kind instead (on {' and '.join(map(str, calibrated_on))}), goodput "
            f"{', '.join(f'{d} {g:.2f}' for d, g in once.items())} req/s: it would recommend {max(once, key=once.get)}")


def predicted_run(planner: Planner, deployment: Deployment, samples: list[Sample], traffic: Traffic) -> Prediction | None:
    """The prediction for a measured run, every request it sent replayed: latencies over the requests that
    finished in it, as they were measured; attainment over all of them. None when none finished."""
    ordered = sorted(samples, key=lambda s: s.t_send)
    simulated = planner.replay(deployment, replayed(ordered))
    finished = [r for r, s in zip(simulated, ordered) if s.ok]
    if not finished:
        return None
    return replace(predict(finished, traffic), attainment=sum(traffic.met(r) for r in simulated) / len(simulated))


def check(planner: Planner, workload: Workload, results: list[Path]) -> None:
    """Predicted vs measured for every crossover load point (each run's own requests, replayed), and the
    median relative errors."""
    errors: dict[str, list[float]] = {"p50 TTFT": [], "p95 ITL": []}
    print(f"{'prompt':>6} {'req/s':>5} {'deployment':<24} | {'p50 TTFT ms pred | meas | err':^29} | "
          f"{'p95 ITL ms pred | meas | err':^28} | attainment pred | meas")
    for path in results:
        raw = json.loads(path.read_text())
        for point in raw["points"]:
            if "samples" not in point:
                raise SystemExit(f"error: {path} names no samples per run (crossover records them since the planner "
                                 "replays them): run `python -m loadtest crossover` again")
            traffic = traffic_of(workload, point["rate"], point["prompt_tokens"])
            for name in ("aggregated", "disaggregated"):
                measured = point[name]
                deployment = Deployment(aggregated=2) if name == "aggregated" else Deployment(prefill=1, decode=1)
                p = predicted_run(planner, deployment, read_samples([path.parent / point["samples"][name]]), traffic)
                if p is None:
                    print(f"{point['prompt_tokens']:>6} {point['rate']:>5g} {str(deployment):<24} | no request finished in the measured run")
                    continue
                row = []
                for label, pred, meas in (("p50 TTFT", p.ttft_p50_s, measured["ttft_ms"]["p50"]),
                                          ("p95 ITL", p.itl_p95_s, measured["itl_ms"]["p95"])):
                    err = (pred * 1e3 - meas) / meas if meas else None
                    if err is not None:
                        errors[label].append(abs(err))
                    row.append(f"{pred * 1e3:>8.0f} | {meas or 0:>6.0f} | {'-' if err is None else f'{err:+.0%}':>6}")
                print(f"{point['prompt_tokens']:>6} {point['rate']:>5g} {str(deployment):<24} | {row[0]:>29} | {row[1]:>28} | "
                      f"{p.attainment:>10.0%} | {measured['slo_attainment']:.0%}")
    for label, errs in errors.items():
        if errs:
            print(f"plan: {label} prediction error: median {np.median(errs):.0%}, worst {max(errs):.0%} over {len(errs)} runs")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-bench.yaml"))
    p.add_argument("--workload", default="prefill-heavy", help="workload YAML or name in loadtest/workloads/")
    p.add_argument("--instances", type=int, help="engine instances to split (default: the spec's prefill + decode)")
    p.add_argument("--rate", type=float, help="expected requests/s (default: the workload's)")
    p.add_argument("--check", type=Path, nargs="*", default=[], help="crossover.json files to compare predictions with")
    p.add_argument("--out", type=Path, default=Path("results/plan"), help="where the equal-budget spec is written")
    p.add_argument("--no-host", action="store_true", help="simulate the engines alone: no front, no shared cores (as on GPUs); "
                   "no calibration")
    p.add_argument("--no-calibration", action="store_true", help="the engines' steps as profiled, without what serving adds to them")
    p.add_argument("--gpu", help=f"a TensorRT-LLM spec: the GPU whose datasheet the step times come from ({', '.join(ACCELERATORS)}; "
                   "default: NVML's first GPU)")
    p.add_argument("--model-config", type=Path, help="a TensorRT-LLM spec: the model's config.json, where model.path has none")
    p.add_argument("--front", type=Path, help="a TensorRT-LLM spec: `bench front`'s front.json, to size the front (CPU cores, "
                   "orchestrator instances) for the recommended deployment's tokens/s")
    a = p.parse_args(argv)
    os.environ.update(THREAD_ENV)
    workload_path = workload_file(a.workload)
    workload = load_workload(workload_path)
    if yaml.safe_load(a.config.read_text()).get("backend") == "tensorrt_llm":
        if a.instances or a.check:
            raise SystemExit("error: --instances and --check: a TensorRT-LLM spec is planned for its own GPUs, from the datasheet")
        return plan_gpus.run(a, traffic_of(workload, a.rate))
    if a.front:
        raise SystemExit("error: --front: for a TensorRT-LLM spec; on the CPU the planner measures the front itself")
    if a.instances is not None and a.instances < 2:
        raise SystemExit("error: --instances must be at least 2: one prefill and one decode instance")
    calibrating = not (a.no_host or a.no_calibration)
    if a.instances is not None and calibrating:
        splittable(a.config)  # refused before any work: each split of --instances is served to calibrate it
    a.out.mkdir(parents=True, exist_ok=True)
    spec, _ = compare_spec(a.config, a.out)  # every role built, aggregated as the crossover runs it
    build(spec, log=lambda line: print(f"build: {line}", flush=True))
    shared = {} if a.no_host else hosts(spec, a.out / "front")
    planner = Planner(profiles(spec), limits_of(spec), handoff(spec), shared, orchestrators=orchestrators_of(spec))
    if calibrating:
        planner = calibrated(planner, spec, workload_path, a.out / "calibration")
    instances = a.instances or spec.roles["prefill"].instances + spec.roles["decode"].instances
    for kind, host in shared.items():
        print(f"plan: {kind}: {host.cores:g} cores shared by the engines and a front costing {host.front_s_per_token * 1e3:.2f} ms "
              "of CPU per output token")
    for role, model in planner.steps.items():
        q = model.prompt
        decode = ", ".join(f"{b}: {model.decode_s(b, 1024) * 1e3:.0f}" for b in model.decode.batches)
        print(f"plan: {role} steps: decode at 1k-token contexts, ms by batch {decode}; with prompt tokens {q.base_s * 1e3:.2f} ms + "
              f"{q.per_token_s * 1e6:.0f} us/token + {q.per_attended_s * 1e9:.2f} ns/attended token (fit within {model.fit_error:.0%})")
    traffic = traffic_of(workload, a.rate)
    calibrated_on = tuple(deployment_of(spec, kind) for kind in ROLES)
    planners = {d: planner for d in deployments(instances, "aggregated" in planner.steps)}
    if calibrating:
        planners = calibrated_each(planner, a.config, instances, workload_path, a.out / "deployments", calibrated_on)
    print(f"plan: workload {workload.name} at {traffic.rate:g} req/s, SLO TTFT <= {workload.ttft_slo_ms:g} ms, "
          f"TPOT <= {workload.tpot_slo_ms:g} ms; {instances} engine instances", flush=True)
    print_plan(ranked(planners, traffic), instances, traffic)
    if line := once_per_kind(planner, planners, calibrated_on, traffic):
        print(line)
    if a.check:
        check(planner, workload, a.check)
    return 0

