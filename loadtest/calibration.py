"""The planner fitted to what serving adds to the profiled engine steps, here and now (`loadtest plan`'s step 1).

A profile times an engine's steps alone. Served, a request also crosses the front, its tokens leave through the
engine's process every step, and the engines share this machine's cores with the front and with each other. So
each deployment is served a few times and the planner's simulation fitted to what its requests took: one at a
time (`_fitted_alone`: the deployment's latency, its decode steps' overhead, its engines' CPU per second of
step), all at once (`per_sequence_cost`), and at load where the engines compute on these cores
(`fitted_at_load`), on each deployment of a split as it is served on its own (`calibrated_each`, `split_spec`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml

from disagg.cli import build
from disagg.planner.plan import Planner, Traffic, deployments
from disagg.planner.profile import StepModel
from disagg.planner.simulate import Deployment, SimRequest
from disagg.repository import role_models
from disagg.spec import DeploymentSpec, load_spec
from loadtest.compare import run_point
from loadtest.samples import Sample, read_samples
from loadtest.server_cpu import TICK_S, ServerCpu
from loadtest.workload import Workload, load_workload, workload_variant

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


def traffic_of(workload: Workload, rate: float | None = None, prompt_tokens: int | None = None) -> Traffic:
    """What the planner simulates of `workload`: its length distributions and SLOs, at `rate` (default its own,
    else 1 req/s); with `prompt_tokens`, prompts of 90-100% of that many tokens instead of its own. Here rather
    than on Workload: the load generator's workers read workloads and need none of the planner."""
    prompt = ((1.0, int(prompt_tokens * 0.9), prompt_tokens),) if prompt_tokens else tuple(
        (b.weight, b.min, b.max) for b in workload.prompt_tokens)
    return Traffic(prompt, tuple((b.weight, b.min, b.max) for b in workload.output_tokens), rate or workload.rate or 1.0,
                   workload.ttft_slo_ms / 1e3, workload.tpot_slo_ms / 1e3)


def replayed(samples: list[Sample]) -> list[SimRequest]:
    """A measured run's requests as the simulation takes them, in the order they were sent: each when it was
    sent, with its prompt and as many tokens as its client received; one that did not finish (it held its
    engine until the run stopped) with as many as it asked for."""
    start = min(s.t_send for s in samples)
    return [SimRequest(s.t_send - start, s.prompt_tokens, max(1, s.n_out if s.ok else s.max_tokens))
            for s in sorted(samples, key=lambda s: s.t_send)]


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}"


def _signed_ms(s: float) -> str:
    return f"{s * 1e3:+.1f} ms"
