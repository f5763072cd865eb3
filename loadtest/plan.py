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
   Then calibrates: ten of the workload's requests, sent one at a time through each deployment: what
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
from collections.abc import Callable
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
from disagg.planner.simulate import Deployment, EngineLimits, Host, Orchestrators, SimRequest
from disagg.repository import role_models
from disagg.spec import DeploymentSpec, load_spec
from loadtest import plan_gpus
from loadtest.compare import THREAD_ENV, compare_spec, run_point
from loadtest.samples import Sample, read_samples
from loadtest.server_cpu import TICK_S, ServerCpu
from loadtest.workload import Workload, load_workload, workload_file, workload_variant


def traffic_of(workload: Workload, rate: float | None = None, prompt_tokens: int | None = None) -> Traffic:
    prompt = ((1.0, int(prompt_tokens * 0.9), prompt_tokens),) if prompt_tokens else tuple(
        (b.weight, b.min, b.max) for b in workload.prompt_tokens)
    return Traffic(prompt, tuple((b.weight, b.min, b.max) for b in workload.output_tokens), rate or workload.rate or 1.0,
                   workload.ttft_slo_ms / 1e3, workload.tpot_slo_ms / 1e3)


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


# One at a time. A role's CPU share read from three requests was 1.10 and 1.21 for the same prompts (1.04 from ten, 1.07
# under load), and the simulation under contention moves with it.
CALIBRATION_REQUESTS = 10
CALIBRATION_BATCH = 24  # requests sent at once: decode batches about as large as the workloads' rates build here
CALIBRATION_PROMPT_TOKENS = 32  # their prompts, short: the batch forms at once and its steps decode, as under load
MAX_PER_SEQUENCE_S = 0.05  # where the search for the cost per generating sequence gives up
LOAD_REQUESTS = 60  # the calibration run at load: a Poisson process of this many requests
LOAD_SHARE = 1.0  # at this share of the deployment's goodput as predicted before it
MAX_DECODE_FACTOR = 2.0  # where the search for the factor on decode work gives up
CONFIRM_BEYOND = 1.2  # a factor at load outside x1/1.2-x1.2 is served again before it is believed (`confirmed`)
AGREE_WITHIN = 1.15  # two factors at load further apart than this call for a third
MIN_LOAD_RATE = 0.1  # req/s: below it LOAD_REQUESTS would take over ten minutes
ROLES = {"aggregated": ("aggregated", "aggregated"), "disaggregated": ("prefill", "decode")}  # kind: its prompt and decode roles
MEASURABLE_TICKS = 50  # a role's steps must last this many CPU-clock ticks for its CPU share to be read within 4%


def calibrated(planner: Planner, spec: DeploymentSpec, workload_path: Path, out: Path) -> Planner:
    """The planner fitted to what serving adds to the profiled steps here and now, for each deployment as `spec`
    serves it (`deployment_of`: its instances of each role, a fresh server per run), in two runs of the workload's requests
    and, where the engines share the cores with the front, a third at load (`fitted_at_load`).

    First a few requests, one at a time, against the same requests simulated one by one. The median of
    measured minus predicted TTFT becomes the deployment's latency (`Planner.latency_s`: the hops between
    client and engines, which hold no engine), that of TPOT an overhead added to every decode step
    (`StepModel.with_decode_overhead`: the step loop's own work, which does hold it). Differences, not ratios:
    a ratio taken from one-at-a-time requests scaled every step, so queues built on time that was not the
    engines' and a batch-1 decode step that happened to profile fast stretched the steps of every batch size
    (replaying the saved `loadtest splits` runs, ratios put p50 TTFT within 20% in 9-12 of 27 runs against
    17-19 of 27 this way; docs/measurements.md). How much of a served step is CPU is measured too: each engine
    process's CPU seconds while the requests ran, over its steps' seconds (`StepModel.cpu_per_wall`), since a
    step that waits leaves its core to the other engines, and one whose process works beside it takes more.
    The kernel counts CPU time in ticks (10 ms), so a role whose steps took under 50 of them keeps one core,
    as the print says.

    Then a batch of requests sent at once, with short prompts and answers as long as the workload's (every token
    generated): the cost per generating sequence (`StepModel.per_sequence_s`) that makes their simulated median TPOT
    the measured one. What serving adds to a step grows with its batch: every sequence's response leaves through the
    engine's process each step, and the more tokens a second the front handles beside the step, the more its memory
    traffic likely slows the step's (a decode step timed beside a process streaming memory ran x1.28-x1.70, `python
    -m disagg.bench corun`). One request at a time cannot show it; under load the decode steps of the saved splits
    runs took 1.2-1.8x their profiled time from batch 8 on, with no prefill beside them."""
    alone = workload_variant(workload_path, out, "calibration", max_requests=CALIBRATION_REQUESTS, duration_s=120,
                             arrival={"users": 1})  # closed loop, one at a time
    batch = min(CALIBRATION_BATCH, spec.roles["decode"].max_batch_size, spec.roles["aggregated"].max_batch_size)
    shortest = min(CALIBRATION_PROMPT_TOKENS, *(b.min for b in alone[1].prompt_tokens))  # the variant keeps the workload's lengths
    batch_path, batch_workload = workload_variant(workload_path, out, "calibration-batch", max_requests=batch, duration_s=120,
                                                  arrival={"users": batch},  # closed loop, all at once
                                                  prompt_tokens=[{"weight": 1.0, "min": shortest, "max": shortest}],
                                                  exact_output_tokens=True)
    for kind, (prompt_role, decode_role) in ROLES.items():
        deployment = deployment_of(spec, kind)
        planner = _fitted_alone(planner, spec, alone, out, kind, deployment, prompt_role, decode_role)
        samples_path, _ = run_point(kind, None, spec, str(batch_path), batch_workload, out)
        together = read_samples([samples_path])
        per_sequence, measured, simulated = per_sequence_cost(planner, deployment, decode_role, together)
        planner = planner.adjusted({decode_role: replace(planner.steps[decode_role], per_sequence_s=per_sequence)})
        print(f"plan: calibration, {kind}: {len(together)} requests sent at once served with median TPOT {_ms(measured)} ms "
              f"against {_ms(simulated)} ms simulated: the {decode_role} engine's steps take {per_sequence * 1e3:.2f} ms more "
              "for each generating sequence after the first", flush=True)
        planner = fitted_at_load(planner, spec, workload_path, out, kind, deployment)
    return planner


def fitted_at_load(planner: Planner, spec: DeploymentSpec, workload_path: Path, out: Path, kind: str,
                   deployment: Deployment) -> Planner:
    """`calibrated`'s last run, where the engines share the cores (elsewhere the planner as it is): LOAD_REQUESTS of the workload's requests arriving
    as a Poisson process at the goodput predicted so far, and the factor on the decode role's decode work that makes
    their median simulated TPOT the measured one (`confirmed`: served again where it is far from x1). Served beside
    prompts and the front, decode steps run slower than alone, the more so the busier the machine, and prompt steps
    do not (replayed, the saved `loadtest splits` runs needed decode work x1.1-1.4 and their prompts as profiled). At
    the goodput, since a step's cost moves TPOT most there: replayed over five saved `splits` runs, a factor fitted on
    the run nearest each deployment's predicted goodput put p50 TPOT within 20% in 52 of the other 65 runs, one fitted
    at half of it in 45, none in 36 of 75; a calibration run at half (one `splits` run) found x0.88 and x1.02
    (docs/measurements.md)."""
    host = planner.hosts.get(kind)
    if host is None or not host.engines_on_cpu:
        return planner
    decode_role = ROLES[kind][1]
    base = load_workload(workload_path)
    rate = round(LOAD_SHARE * planner.goodput(deployment, traffic_of(base)), 2)
    if rate < MIN_LOAD_RATE:
        print(f"plan: calibration, {deployment}: predicted to sustain under {MIN_LOAD_RATE:g} req/s within the SLOs; its decode "
              "work is not calibrated at load", flush=True)
        return planner

    def factor_of_run(n: int) -> float:
        """The n-th run's factor, its arrivals drawn anew (a burst in one is not served twice)."""
        where = out if n == 0 else out / f"again{n}"
        path, loaded = workload_variant(workload_path, where, "calibration-load", max_requests=LOAD_REQUESTS,
                                        duration_s=LOAD_REQUESTS / rate + 30.0, arrival={"rate": rate}, seed=base.seed + n)
        samples_path, _ = run_point(kind, rate, spec, str(path), loaded, where)
        factor, measured, simulated = decode_factor(planner, deployment, decode_role, read_samples([samples_path]))
        print(f"plan: calibration, {deployment}: {LOAD_REQUESTS} requests at {rate:g} req/s served with median TPOT {_ms(measured)} ms "
              f"against {_ms(simulated)} ms simulated with the {decode_role} engine's decode work x{factor:.2f}", flush=True)
        return factor

    factor, factors = confirmed(factor_of_run)
    if len(factors) > 1:
        print(f"plan: calibration, {deployment}: decode work x{factor:.2f}, the median of {', '.join(f'x{f:.2f}' for f in factors)} "
              f"(a factor outside x{1 / CONFIRM_BEYOND:.2f}-x{CONFIRM_BEYOND:.2f} is served again before it is believed)", flush=True)
    return planner.adjusted({decode_role: planner.steps[decode_role].decode_scaled(factor)})


def confirmed(factor_of_run: Callable[[int], float]) -> tuple[float, list[float]]:
    """A factor at load, and the runs' factors it is the median of: one run, a second where it is beyond
    CONFIRM_BEYOND either way, a third where the two differ by more than AGREE_WITHIN. At the goodput a run's
    TPOT sits at the knee, where a slow spell of the machine moves it most: in one `loadtest splits` run a
    deployment's calibration served median TPOT 114 ms at 2.53 req/s (x1.86), and its run at 2.6 req/s minutes
    later 68 ms. The other 29 calibrations at load of five such runs found x0.70-x1.40, 4 of them beyond x1.2 either
    way (docs/measurements.md)."""
    factors = [factor_of_run(0)]
    if not 1 / CONFIRM_BEYOND <= factors[0] <= CONFIRM_BEYOND:
        factors.append(factor_of_run(1))
        if max(factors) / min(factors) > AGREE_WITHIN:
            factors.append(factor_of_run(2))
    return float(np.median(factors)), factors


def splittable(config: Path) -> dict:
    """`config`'s YAML, where every split of its instances can be served from it: prefill, decode and aggregated
    roles of one engine rank per instance (an instance is what a split counts)."""
    raw = yaml.safe_load(config.read_text())
    for role in ("prefill", "decode", "aggregated"):
        spec = raw["roles"].get(role)
        if spec is None:
            raise SystemExit(f"error: {config} has no role {role}: a split needs prefill, decode and aggregated")
        if spec.get("tp", 1) * spec.get("pp", 1) != 1:
            raise SystemExit(f"error: roles.{role}: a split counts one engine rank per instance, and tp * pp is not 1")
    return raw


def split_spec(config: Path, out: Path, instances: int, prefill: int) -> DeploymentSpec:
    """`config` with `prefill` prefill and `instances - prefill` decode instances, and `instances` aggregated
    ones, rendered into its own model repository under `out`."""
    raw = splittable(config)
    for role, count in (("prefill", prefill), ("decode", instances - prefill), ("aggregated", instances)):
        raw["roles"][role]["instances"] = count
    where = out / deployment_dir(Deployment(prefill=prefill, decode=instances - prefill))
    where.mkdir(parents=True, exist_ok=True)
    raw["output"] = {**raw.get("output", {}), "model_repository": str(where / "model_repository")}
    path = where / "spec.yaml"
    path.write_text(f"# {config}, {prefill} prefill + {instances - prefill} decode instances, served on its own\n"
                    + yaml.safe_dump(raw, sort_keys=False))
    return load_spec(path)


def deployment_dir(deployment: Deployment) -> str:
    """A directory's name for `deployment`'s repository and runs: prefill2-decode1, aggregated3."""
    return str(deployment).replace(" x", "").replace(" + ", "-")


def calibrated_each(planner: Planner, config: Path, instances: int, workload_path: Path, out: Path,
                    calibrated_on: tuple[Deployment, ...]) -> dict[Deployment, Planner]:
    """Every deployment of `instances` with its own planner: `planner` calibrated at load on that deployment
    (`fitted_at_load`), its repository built (`split_spec`, under `out`) and served, but for the deployments `planner`
    was calibrated on and where the engines do not share the cores. Which engines share the cores changes how much
    they slow each other, and the machine drifts between calibrations: in `loadtest splits` runs, predictions calibrated
    on each deployment put p50 TPOT within 20% in 44 of 45 runs, one calibration per kind in 42 (docs/measurements.md)."""
    planners, specs = {}, {}
    for deployment in deployments(instances, "aggregated" in planner.steps):
        host = planner.hosts.get(deployment.kind)
        if deployment in calibrated_on or host is None or not host.engines_on_cpu:
            planners[deployment] = planner
            continue
        prefill = deployment.prefill or 1  # every split's repository also serves aggregated x instances
        if prefill not in specs:
            specs[prefill] = split_spec(config, out, instances, prefill)
            build(specs[prefill], log=lambda line: print(f"build: {line}", flush=True))
        planners[deployment] = fitted_at_load(planner, specs[prefill], workload_path, out / deployment_dir(deployment) / "calibration",
                                              deployment.kind, deployment)
    return planners


def deployment_of(spec: DeploymentSpec, kind: str) -> Deployment:
    """The deployment of `kind` that `spec` serves: every instance of its roles (loadtest.compare's
    deployment_models loads them all), which calibration simulates, since a batch sent at once spreads over them."""
    r = spec.roles
    if kind == "aggregated":
        return Deployment(aggregated=r["aggregated"].instances)
    return Deployment(prefill=r["prefill"].instances, decode=r["decode"].instances)


def _fitted_alone(planner: Planner, spec: DeploymentSpec, workload: tuple[Path, Workload], out: Path, kind: str,
                  deployment: Deployment, prompt_role: str, decode_role: str) -> Planner:
    """`calibrated`'s first run, one request at a time (`workload`: its file and what it holds): the deployment's
    latency, its decode steps' overhead and its engines' CPU per second of step."""
    path, loaded = workload
    with ServerCpu() as cpu:
        samples_path, _ = run_point(kind, None, spec, str(path), loaded, out)
    served = [s for s in read_samples([samples_path]) if s.ok]
    samples = [s for s in served if s.tpot]
    if not samples:
        raise SystemExit(f"error: calibration: no {kind} request completed with two tokens or more (see {samples_path})")
    predicted = [planner.replay(deployment, replayed([s]))[0] for s in samples]  # each alone, as served
    latency = float(np.median([s.ttft - r.ttft for s, r in zip(samples, predicted)]))
    overhead = float(np.median([s.tpot - r.tpot for s, r in zip(samples, predicted)]))
    steps = dict(planner.steps)
    steps[decode_role] = steps[decode_role].with_decode_overhead(overhead)
    used = cpu.between(min(s.start_unix for s in served), max(s.start_unix + s.e2e for s in served))
    busy, shares = {}, []
    host = planner.hosts.get(kind)  # none: engines alone, on the cores as profiled
    if host is None or host.engines_on_cpu:
        busy[prompt_role] = sum(steps[prompt_role].prefill_s(s.prompt_tokens) for s in served)
        busy[decode_role] = busy.get(decode_role, 0.0) + sum(
            steps[decode_role].decode_s(1, s.prompt_tokens + i) for s in served for i in range(1, s.n_out))
    else:
        shares.append("the engines step off the CPU (GPU stand-ins): their CPU share is not simulated")
    for role, seconds in busy.items():
        if seconds < MEASURABLE_TICKS * TICK_S:
            shares.append(f"the {role} engine's steps took {_ms(seconds)} ms, too short to read its CPU in "
                          f"{_ms(TICK_S)} ms ticks: taken as one core")
            continue
        engine_cpu = sum(used.get(f"stub {model}", 0.0) for model in role_models(spec, role))
        if not engine_cpu:
            raise SystemExit(f"error: calibration: no CPU time measured for the {role} engine's process ({kind}, "
                             f"processes seen: {', '.join(sorted(used)) or 'none'})")
        steps[role] = replace(steps[role], cpu_per_wall=engine_cpu / seconds)
        shares.append(f"the {role} engine kept {steps[role].cpu_per_wall:.2f} of a core busy")
    print(f"plan: calibration, {kind}: {len(samples)} requests one at a time served with TTFT {_signed_ms(latency)} and "
          f"TPOT {_signed_ms(overhead)} against the simulation: its tokens reach the client {abs(latency) * 1e3:.1f} ms "
          f"{'later' if latency >= 0 else 'sooner'} than simulated, "
          f"the {decode_role} engine's decode steps {_signed_ms(overhead)} each; " + ", ".join(shares), flush=True)
    return planner.adjusted(steps, {kind: latency})


def per_sequence_cost(planner: Planner, deployment: Deployment, role: str, samples: list[Sample]) -> tuple[float, float, float]:
    """The cost per generating sequence after the first, in `role`'s steps, that makes the median simulated
    TPOT of `samples` (a run's requests, replayed together) the measured one. Never below 0: what serving adds
    does not make steps faster than the engine alone (a batch served faster than simulated keeps 0). Returns it
    with the measured and simulated medians."""
    measured, simulated = _tpot_against(planner, deployment, samples,
                                        lambda cost: {role: replace(planner.steps[role], per_sequence_s=cost)})
    cost, at = _bisected(simulated, measured, 0.0, MAX_PER_SEQUENCE_S, 1e-6)
    if at < measured:
        raise SystemExit(f"error: calibration: {deployment}'s batch served with median TPOT {_ms(measured)} ms, slower than "
                         f"simulated even with {_ms(MAX_PER_SEQUENCE_S)} ms more per sequence and step: is the machine busy with other work?")
    return cost, measured, at


def decode_factor(planner: Planner, deployment: Deployment, role: str, samples: list[Sample]) -> tuple[float, float, float]:
    """The factor on `role`'s decode work that makes the median simulated TPOT of `samples` (a run at load,
    replayed) the measured one, within 1/MAX_DECODE_FACTOR and MAX_DECODE_FACTOR. Returns it with the measured
    and simulated medians (which differ where the factor is at a bound)."""
    measured, simulated = _tpot_against(planner, deployment, samples, lambda f: {role: planner.steps[role].decode_scaled(f)})
    factor, at = _bisected(simulated, measured, 1 / MAX_DECODE_FACTOR, MAX_DECODE_FACTOR, 1e-3)
    return factor, measured, at


def _tpot_against(planner: Planner, deployment: Deployment, samples: list[Sample],
                  steps_at: Callable[[float], dict[str, StepModel]]) -> tuple[float, Callable[[float], float]]:
    """A run's median measured TPOT, and the median simulated one as a function of x, with the planner's steps
    changed by `steps_at(x)` (a mapping of roles to StepModels)."""
    ordered = sorted(samples, key=lambda s: s.t_send)
    finished = [i for i, s in enumerate(ordered) if s.ok and s.tpot]
    if not finished:
        raise SystemExit(f"error: calibration: no request of the run completed with two tokens or more ({deployment})")

    def simulated(x: float) -> float:
        served = planner.adjusted(steps_at(x)).replay(deployment, replayed(ordered))
        return float(np.median([served[i].tpot or 0.0 for i in finished]))

    return float(np.median([ordered[i].tpot for i in finished])), simulated


def _bisected(simulated: Callable[[float], float], measured: float, lo: float, hi: float, tolerance: float) -> tuple[float, float]:
    """The least x in [lo, hi] whose `simulated(x)` (a longer step never shortens a TPOT) reaches `measured`, with
    simulated(x): lo if simulated(lo) already does, hi if simulated(hi) does not."""
    at_lo = simulated(lo)
    if at_lo >= measured:
        return lo, at_lo
    at_hi = simulated(hi)
    if at_hi < measured:
        return hi, at_hi
    while hi - lo > tolerance:
        mid = (lo + hi) / 2
        at_mid = simulated(mid)
        if at_mid < measured:
            lo = mid
        else:
            hi, at_hi = mid, at_mid
    return hi, at_hi


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


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def _signed_ms(s: float) -> str:
    return f"{s * 1e3:+.1f} ms"


def print_plan(options: list[Option], instances: int, traffic: Traffic) -> None:
    print(f"{'deployment':<24} {'decode batch':>12} | {'goodput req/s':>13} {'per instance':>12} | "
          f"at {traffic.rate:g} req/s: {'p50 TTFT ms':>11} {'p95 ITL ms':>10} {'attainment':>10}")
    for o in options:
        p = o.at_rate
        print(f"{str(o.deployment):<24} {o.decode_batch or '-':>12} | {o.goodput:>13.2f} {o.per_instance:>12.3f} | "
              f"{'':>{len(f'at {traffic.rate:g} req/s: ')}}{_ms(p.ttft_p50_s):>11} {_ms(p.itl_p95_s):>10} {p.attainment:>10.0%}")
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


def replayed(samples: list[Sample]) -> list[SimRequest]:
    """A measured run's requests as the simulation takes them, in the order they were sent: each when it was
    sent, with its prompt and as many tokens as its client received; one that did not finish (it held its
    engine until the run stopped) with as many as it asked for."""
    start = min(s.t_send for s in samples)
    return [SimRequest(s.t_send - start, s.prompt_tokens, max(1, s.n_out if s.ok else s.max_tokens))
            for s in sorted(samples, key=lambda s: s.t_send)]


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
                    row.append(f"{_ms(pred):>8} | {meas or 0:>6.0f} | {'-' if err is None else f'{err:+.0%}':>6}")
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

