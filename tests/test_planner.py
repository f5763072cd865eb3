"""The planner: step-model fit, the simulated schedule step by step, the split search, a profiled engine."""
from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from disagg.cli import build
from disagg.engine.no_compute import skipped_compute
from disagg.planner.plan import Planner, Traffic, deployments, predict, ranked
from disagg.planner.profile import PROBE_STEPS, DecodeTable, Linear, SpeedProbe, StepModel, Timed, fit, profile_engine
from disagg.planner.simulate import Deployment, EngineLimits, Host, Orchestrators, SimRequest, simulate
from disagg.spec import load_spec
from loadtest.compare import compare_spec
from loadtest.calibration import (
    CALIBRATION_REQUESTS, LOAD_REQUESTS, ROLES, calibrated, calibrated_each, confirmed, decode_factor, deployment_of, fitted_at_load,
    per_sequence_cost, replayed, split_spec, traffic_of,
)
from loadtest.plan import check, front_s_per_token, limits_of, once_per_kind, predicted_run, profiles
from loadtest.samples import Sample, read_samples
from loadtest.workload import WORKLOAD_DIR, load_workload, workload_variant

MS = 1e-3
ROOT = Path(__file__).resolve().parent.parent
FLAT = StepModel(DecodeTable((1,), (1 * MS,), (0.0,)), Linear(1 * MS, 0.0, 0.0), 0.0)  # every step 1 ms


def test_fit_recovers_the_step_model_it_was_sampled_from():
    # a CPU's decode: batch 2 far dearer than batch 1 (matrix-matrix products), then nearly flat
    truth = StepModel(DecodeTable((1, 2, 8, 32), (4 * MS, 11 * MS, 13 * MS, 30 * MS), (6e-6, 6e-6, 5e-6, 5e-6)),
                      Linear(2 * MS, 170e-6, 0.8e-9), fit_error=0.0)
    steps = [Timed(b, b * c, 0, 0.0, truth.decode_s(b, c)) for b in (1, 2, 8) for c in (100, 1000)]
    steps.append(Timed(32, 32 * 100, 0, 0.0, truth.decode_s(32, 100)))  # one context only: the neighbour's slope
    steps += [Timed(0, 0.0, n, n * (n + 1) / 2, truth.prefill_s(n)) for n in (16, 256, 1024)]
    steps += [Timed(d, d * 300.0, 64, 64 * (o + 32.5), truth.step_s(d, d * 300.0, 64, 64 * (o + 32.5)))
              for d, o in ((4, 0), (4, 512), (16, 1536))]  # chunks beside decodes
    got = fit(steps)
    assert got.decode.batches == truth.decode.batches
    assert got.decode.base_s == pytest.approx(truth.decode.base_s, rel=1e-6)
    assert got.decode.per_attended_s == pytest.approx(truth.decode.per_attended_s, rel=1e-6)
    for coef in ("base_s", "per_token_s", "per_attended_s"):
        assert getattr(got.prompt, coef) == pytest.approx(getattr(truth.prompt, coef), rel=1e-6)
    assert got.fit_error < 1e-6
    # between profiled batches: linear in the batch size
    assert got.decode_s(5, 500) == pytest.approx((11 * MS + 13 * MS) / 2 + (6e-6 + 5e-6) / 2 * 5 * 500, rel=1e-6)
    raw = {"decode": vars(truth.decode), "prompt": vars(truth.prompt), "fit_error": 0.0}
    assert StepModel.from_dict(json.loads(json.dumps(raw))) == truth


def test_a_decode_batch_timed_at_one_context_is_no_slope():
    with pytest.raises(ValueError, match="one context"):
        fit([Timed(4, 4 * 100 + i * 4, 0, 0.0, 10 * MS) for i in range(4)] + [Timed(0, 0.0, 16, 136.0, 5 * MS)])


def test_aggregated_chunks_a_prompt_over_steps_and_decodes_one_token_per_step():
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    req = SimRequest(arrival=0.0, prompt=100, output=3)
    simulate(Deployment(aggregated=1), {"aggregated": FLAT}, limits, [req], lambda n: 0.0)
    # chunks of 32, 32, 32, 4: the first token with the last chunk (step 4), then one token a step
    assert req.token_times == pytest.approx([4 * MS, 5 * MS, 6 * MS])
    assert req.ttft == pytest.approx(4 * MS) and req.tpot == pytest.approx(1 * MS)


def test_a_running_decode_leaves_room_in_the_budget_and_waits_for_each_chunk():
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=33, chunked=True, tokens_per_block=16)}
    first, second = SimRequest(0.0, 16, 4), SimRequest(0.0005, 64, 2)
    simulate(Deployment(aggregated=1), {"aggregated": FLAT}, limits, [first, second], lambda n: 0.0)
    assert first.token_times == pytest.approx([1 * MS, 2 * MS, 3 * MS, 4 * MS])
    # step 2 onwards: 1 decode token + 32 of the prompt (33 - 1, in units of 16) each step
    assert second.token_times == pytest.approx([3 * MS, 4 * MS])


def test_disaggregated_hands_off_after_the_context_phase():
    limits = {
        "prefill": EngineLimits(2, 512, False, 16),
        "decode": EngineLimits(8, 8, True, 16),
    }
    steps = {"prefill": StepModel(DecodeTable((1,), (0.0,), (0.0,)), Linear(0.0, 0.1 * MS, 0.0), 0.0), "decode": FLAT}
    req = SimRequest(0.0, 200, 4)
    simulate(Deployment(prefill=1, decode=1), steps, limits, [req], lambda n: n * 0.01 * MS)
    # prefill 200 x 0.1 ms = 20 ms (first token), handoff 2 ms, then a token per 1 ms decode step
    assert req.token_times == pytest.approx([20 * MS, 23 * MS, 24 * MS, 25 * MS])


def test_aggregated_instances_take_requests_in_turn_and_decodes_go_to_the_least_loaded():
    """Triton hands the aggregated engine model's requests to its instances in turn, whatever each holds; the
    orchestrator sends a decode to its least loaded instance. A long request, a short one that is over by 3 ms,
    then another short one at 3.2 ms; every step 1 ms."""
    limits = {"aggregated": EngineLimits(8, 512, False, 16), "prefill": EngineLimits(8, 512, False, 16),
              "decode": EngineLimits(8, 8, True, 16)}
    steps = {"aggregated": FLAT, "prefill": FLAT, "decode": FLAT}

    def requests() -> list[SimRequest]:
        return [SimRequest(0.0, 16, 20), SimRequest(0.5 * MS, 16, 2), SimRequest(3.2 * MS, 16, 2)]

    aggregated = simulate(Deployment(aggregated=2), steps, limits, requests(), lambda n: 0.0)
    # in turn: the third goes to the first instance, beside the long one, though the second is idle
    assert aggregated[2].token_times == pytest.approx([5 * MS, 6 * MS])
    split = simulate(Deployment(prefill=1, decode=2), steps, limits, requests(), lambda n: 0.0)
    # least loaded: its decode goes to the idle second decode instance, not beside the long one
    assert split[2].token_times == pytest.approx([4.2 * MS, 5.2 * MS])


def test_a_request_past_the_orchestrators_max_in_flight_waits_for_a_worker():
    """Each orchestrator instance serves `max_in_flight` requests at once (a worker thread each); the next one
    waits for a request to send its last token, and that wait is part of its TTFT. Triton hands the requests
    to the instances in turn. Two requests at once, every step 1 ms, two aggregated instances."""
    limits = {"aggregated": EngineLimits(8, 512, False, 16)}

    def served(orchestrators: Orchestrators | None) -> list[float]:
        reqs = [SimRequest(0.0, 16, 3), SimRequest(0.0, 16, 3)]
        simulate(Deployment(aggregated=2), {"aggregated": FLAT}, limits, reqs, lambda n: 0.0, None, orchestrators)
        return [t for r in reqs for t in r.token_times]

    assert served(Orchestrators(instances=1, max_in_flight=1)) == pytest.approx([1 * MS, 2 * MS, 3 * MS, 4 * MS, 5 * MS, 6 * MS])
    assert served(Orchestrators(instances=2, max_in_flight=1)) == pytest.approx([1 * MS, 2 * MS, 3 * MS] * 2)
    assert served(None) == served(Orchestrators(instances=1, max_in_flight=2))


def test_a_prompt_over_the_budget_waits_without_chunked_context():
    limits = {"prefill": EngineLimits(4, 100, False, 16), "decode": EngineLimits(8, 8, True, 16)}
    steps = {"prefill": FLAT, "decode": FLAT}
    a, b = SimRequest(0.0, 80, 2), SimRequest(0.0, 80, 2)
    simulate(Deployment(prefill=1, decode=1), steps, limits, [a, b], lambda n: 0.0)
    assert (a.token_times[0], b.token_times[0]) == pytest.approx((1 * MS, 2 * MS))  # one whole prompt per step


def test_on_a_shared_core_the_front_and_the_engine_take_turns():
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    req = SimRequest(0.0, prompt=16, output=3)
    simulate(Deployment(aggregated=1), {"aggregated": FLAT}, limits, [req], lambda n: 0.0, Host(cores=1, front_s_per_token=0.5 * MS))
    # step 1 alone (1 ms); then its token's front work (0.5 ms) and step 2 share the core at half speed
    # each: the token reaches the client at 2 ms, step 2 ends at 2.5 ms; again for step 3 (3.5, 4.0); the
    # last token's front work runs alone: 4.5 ms.
    assert req.token_times == pytest.approx([2 * MS, 3.5 * MS, 4.5 * MS])


def test_decode_steps_running_together_slow_each_other_beyond_sharing_the_cores():
    """Two engines on two cores: prompt steps side by side keep their time, decode-only steps side by side take
    `decode_interference` longer each (they stream the same memory); alone, a decode step keeps its time."""
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    host = Host(cores=2, front_s_per_token=0.0, decode_interference=0.25)
    pair = [SimRequest(0.0, prompt=16, output=3), SimRequest(0.0, prompt=16, output=3)]
    simulate(Deployment(aggregated=2), {"aggregated": FLAT}, limits, pair, lambda n: 0.0, host)
    for req in pair:
        assert req.token_times == pytest.approx([1 * MS, 2.25 * MS, 3.5 * MS])
    alone = SimRequest(0.0, prompt=16, output=3)
    simulate(Deployment(aggregated=2), {"aggregated": FLAT}, limits, [alone], lambda n: 0.0, host)
    assert alone.token_times == pytest.approx([1 * MS, 2 * MS, 3 * MS])


def test_engines_off_the_cpu_leave_the_front_its_cores():
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    req = SimRequest(0.0, prompt=16, output=3)
    simulate(Deployment(aggregated=1), {"aggregated": FLAT}, limits, [req], lambda n: 0.0,
             Host(cores=2, front_s_per_token=0.5 * MS, engines_on_cpu=False))
    assert req.token_times == pytest.approx([1.25 * MS, 2.25 * MS, 3.25 * MS])  # 0.5 ms of CPU over 2 cores


@pytest.mark.parametrize("cpu_per_wall, step_ms", [(1.0, 2.0), (0.5, 1.0), (1.5, 3.0)])
def test_a_step_takes_from_a_shared_core_what_its_engine_keeps_busy(cpu_per_wall, step_ms):
    """Two engines stepping at once on one core, each step 1 ms alone: steps that keep a whole core busy
    take turns (2 ms each); steps that wait half their time both run as fast as alone; steps whose process
    keeps 1.5 cores busy (1.5 ms of CPU each) need 3 ms of the one core for the two."""
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    steps = {"aggregated": dataclasses.replace(FLAT, cpu_per_wall=cpu_per_wall)}
    reqs = [SimRequest(0.0, prompt=16, output=3) for _ in range(2)]
    simulate(Deployment(aggregated=2), steps, limits, reqs, lambda n: 0.0, Host(cores=1, front_s_per_token=0.0))
    for r in reqs:
        assert r.token_times == pytest.approx([step_ms * MS * k for k in (1, 2, 3)])


def test_a_busy_front_delivers_every_request_s_tokens_in_order():
    limits = {"prefill": EngineLimits(4, 512, False, 16), "decode": EngineLimits(8, 64, True, 16)}
    reqs = [SimRequest(i * 0.3 * MS, 32 + 16 * i, 20) for i in range(6)]
    simulate(Deployment(prefill=1, decode=1), {"prefill": FLAT, "decode": FLAT}, limits, reqs, lambda n: 0.0,
             Host(cores=1, front_s_per_token=0.4 * MS))
    for r in reqs:
        assert len(r.token_times) == 20 and r.token_times == sorted(r.token_times)
    # 120 tokens x 0.4 ms of front work on one core, beside the steps: the last token no earlier than 48 ms
    assert max(r.token_times[-1] for r in reqs) >= 48 * MS


def _planner() -> Planner:
    decode = DecodeTable((1, 32), (5.05 * MS, 6.6 * MS), (0.0, 0.0))
    model = StepModel(decode, Linear(5 * MS, 0.5 * MS, 1e-7), 0.0)  # a long prompt: tens of decode steps
    limits = {"prefill": EngineLimits(2, 2048, False, 32), "decode": EngineLimits(32, 64, True, 32),
              "aggregated": EngineLimits(32, 256, True, 32)}
    return Planner({"prefill": model, "decode": model, "aggregated": model}, limits, lambda n: 0.0, requests=80)


def test_goodput_grows_with_instances_and_options_come_best_first():
    planner, traffic = _planner(), Traffic(((1.0, 1000, 1500),), ((1.0, 64, 128),), 1.0, ttft_slo_s=4.0, tpot_slo_s=0.15)
    two = planner.goodput(Deployment(prefill=1, decode=1), traffic, 32)
    four = planner.goodput(Deployment(prefill=3, decode=1), traffic, 32)
    assert 0 < two < four
    at_goodput = predict(planner.run(Deployment(prefill=1, decode=1), traffic, two, 32), traffic)
    assert at_goodput.attainment >= 0.9
    options = planner.options(4, traffic)
    assert len(options) == 3 * 3 + 1  # 3 splits x decode batches 8, 16, 32, and aggregated x4
    assert options[0].goodput >= max(o.goodput for o in options) * 0.98
    best_split = next(o for o in options if not o.deployment.aggregated)
    assert best_split.deployment.prefill >= 2  # prompts of 1-1.5k tokens: prefill is the bottleneck


def test_each_deployment_is_ranked_by_its_own_planner():
    """`loadtest plan` calibrates each candidate on itself: aggregated, whose planner found its engines' steps
    twice as long, loses its rank to the split, while the options of one planner for all are ranked as before."""
    planner, traffic = _planner(), Traffic(((1.0, 1000, 1500),), ((1.0, 64, 128),), 1.0, ttft_slo_s=4.0, tpot_slo_s=0.15)
    split, aggregated = Deployment(prefill=1, decode=1), Deployment(aggregated=2)
    assert deployments(2) == [split, aggregated] and deployments(3, aggregated=False) == [Deployment(1, 2), Deployment(2, 1)]
    assert ranked({d: planner for d in deployments(2)}, traffic) == planner.options(2, traffic)
    slow = planner.adjusted({"aggregated": planner.steps["aggregated"].slower(2.0)})
    alike, own = ranked({split: planner, aggregated: planner}, traffic), ranked({split: planner, aggregated: slow}, traffic)
    assert alike[0].deployment == aggregated and own[0].deployment == split
    ours = next(o for o in own if o.deployment == aggregated)
    assert ours.goodput == slow.goodput(aggregated, traffic) < next(o for o in alike if o.deployment == aggregated).goodput
    assert [o for o in own if o.deployment == split] == [o for o in alike if o.deployment == split]


def test_plan_says_what_one_calibration_per_kind_would_have_recommended():
    planner, traffic = _planner(), Traffic(((1.0, 1000, 1500),), ((1.0, 64, 128),), 1.0, ttft_slo_s=4.0, tpot_slo_s=0.15)
    split, aggregated = Deployment(prefill=1, decode=1), Deployment(aggregated=2)
    assert once_per_kind(planner, {split: planner, aggregated: planner}, (split, aggregated), traffic) is None
    slow = planner.adjusted({"aggregated": planner.steps["aggregated"].slower(2.0)})
    line = once_per_kind(planner, {split: planner, aggregated: slow}, (split, aggregated), traffic)
    assert line == (f"plan: calibrated once per kind instead (on prefill x1 + decode x1 and aggregated x2), goodput prefill x1 + decode x1 "
                    f"{planner.goodput(split, traffic):.2f}, aggregated x2 {planner.goodput(aggregated, traffic):.2f} req/s: "
                    "it would recommend aggregated x2")


def test_each_deployment_keeps_the_planner_where_calibrating_it_at_load_would_change_nothing(tmp_path):
    """Deployments the planner was calibrated on, and engines off the cores, are neither built nor served."""
    on_cpu = {"disaggregated": Host(cores=2, front_s_per_token=0.2 * MS), "aggregated": Host(cores=2, front_s_per_token=0.2 * MS)}
    off = {kind: dataclasses.replace(host, engines_on_cpu=False) for kind, host in on_cpu.items()}
    for hosts, calibrated_on in ((on_cpu, tuple(deployments(3))), (off, ()), ({}, ())):
        planner = Planner({"prefill": FLAT, "decode": FLAT, "aggregated": FLAT}, _planner().limits, lambda n: 0.0, hosts)
        planners = calibrated_each(planner, tmp_path / "absent.yaml", 3, tmp_path / "absent-workload.yaml", tmp_path, calibrated_on)
        assert planners == {d: planner for d in deployments(3)}
    assert not any(tmp_path.iterdir())


@pytest.mark.e2e
def test_a_deployment_not_calibrated_on_is_built_served_and_calibrated_at_load_on_itself(cpu_tiny_project, tmp_path, capsys):
    """The one split of three instances the planner was not calibrated on gets a repository of its own, serves
    the workload's requests at its predicted goodput, and a planner whose decode work is fitted to them. Its steps
    profiled 40 ms where cpu-tiny's take about 2, the factor comes out at its bound, x0.50, far from x1: served
    again, on arrivals drawn anew, before it is believed."""
    workload, _ = workload_variant(WORKLOAD_DIR / "quick.yaml", tmp_path, "short", prompt_tokens=[{"weight": 1.0, "min": 8, "max": 16}],
                                   output_tokens=[{"weight": 1.0, "min": 8, "max": 16}], shared_prefix={"fraction": 0.0},
                                   slo={"ttft_ms": 2000, "tpot_ms": 200})
    hosts = {kind: Host(cores=2, front_s_per_token=0.2 * MS) for kind in ROLES}
    limits = {role: EngineLimits(8, 256, True, 16) for role in ("prefill", "decode", "aggregated")}
    slow = StepModel(DecodeTable((1,), (40 * MS,), (0.0,)), Linear(40 * MS, 0.0, 0.0), 0.0)  # about 16 req/s: 60 in 4 s
    planner = Planner({"prefill": slow, "decode": slow, "aggregated": slow}, limits, lambda n: 0.0, hosts)
    fitted = Deployment(prefill=2, decode=1)
    with contextlib.chdir(cpu_tiny_project):
        planners = calibrated_each(planner, Path("configs/cpu-tiny.yaml"), 3, workload, tmp_path,
                                   (Deployment(prefill=1, decode=2), Deployment(aggregated=3)))
    assert {d for d, p in planners.items() if p is planner} == {Deployment(prefill=1, decode=2), Deployment(aggregated=3)}
    samples = read_samples([next((tmp_path / "prefill2-decode1" / "calibration" / "samples").glob("disaggregated-*.jsonl"))])
    assert len(samples) == LOAD_REQUESTS and sum(s.ok for s in samples) >= LOAD_REQUESTS - 2
    factor = planners[fitted].steps["decode"].decode_s(1, 16) / slow.decode_s(1, 16)
    assert factor != pytest.approx(1.0) and planners[fitted].steps["prefill"] == slow  # prompts as profiled, decode work refitted
    assert (tmp_path / "prefill2-decode1" / "model_repository").is_dir() and not (tmp_path / "prefill1-decode2").exists()
    out = capsys.readouterr().out
    assert out.count(f"plan: calibration, prefill x2 + decode x1: {LOAD_REQUESTS} requests at") == 2  # x0.50, the bound: again
    again = read_samples([next((tmp_path / "prefill2-decode1" / "calibration" / "again1" / "samples").glob("disaggregated-*.jsonl"))])
    assert len(again) == LOAD_REQUESTS and [s.prompt_tokens for s in again] != [s.prompt_tokens for s in samples]  # drawn anew
    assert "decode work x0.50, the median of x0.50, x0.50 (a factor outside x0.83-x1.20" in out


def test_goodput_is_zero_where_no_rate_meets_the_slos():
    planner = _planner()
    impossible = Traffic(((1.0, 1000, 1500),), ((1.0, 64, 128),), 1.0, ttft_slo_s=1e-4, tpot_slo_s=0.15)
    assert planner.goodput(Deployment(prefill=1, decode=1), impossible, 32) < 1e-3


def test_profile_of_the_tiny_engine_fits_its_steps(cpu_tiny_project):
    model = profile_engine(cpu_tiny_project / "build" / "engines" / "aggregated", progress=False)
    # Sub-millisecond steps on a shared 2-core machine are noisy: only what no noise can turn around.
    assert model.prefill_s(256) > 4 * model.decode_s(1, 16)
    assert model.decode.batches == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)  # every size up to the engine's 32


def test_a_stand_in_is_profiled_as_the_gpu_it_stands_for_under_a_cache_key_of_its_own(cpu_tiny_project):
    """Engines standing in for GPUs (2 ms a step + 0.1 ms per token, off the CPU) profile as that rule, not as the
    tiny model's arithmetic, and their profile is kept apart from the computing engines'."""
    with contextlib.chdir(cpu_tiny_project), skipped_compute(2.0, 0.1):
        spec = load_spec(Path("configs/cpu-tiny.yaml"))
        models = profiles(spec)
        cache = json.loads((spec.build_dir / "planner-profile.json").read_text())
    for role, model in models.items():
        assert model.prefill_s(200) == pytest.approx(0.002 + 200 * 0.0001, rel=0.15), (role, model)
        batch = max(model.decode.batches)  # 4 for prefill, 32 for the others
        rule = 0.002 + batch * 0.0001  # no step sleeps less; the engine's own work per sequence comes on top
        assert 0.97 * rule <= model.decode_s(batch, 100) <= rule + 0.002, (role, model)
        assert model.decode_s(1, 100) == pytest.approx(0.002 + 0.0001, rel=0.25), (role, model)
    assert sorted(key.split("#")[1].split(" ", 1)[1] for key in cache if "stand-in" in key) == ["stand-in 2.0 ms + 0.1 ms/token"] * 3


def test_a_cached_profile_serves_until_one_is_asked_for_again(cpu_tiny_project, monkeypatch, capsys):
    """`again` (splits, whose predictions are checked against runs made now) profiles every role anew and caches
    the new tables; otherwise the cached ones serve. A stand-in rule no other test uses keeps these apart."""
    timed = iter(range(1, 100))
    monkeypatch.setattr("loadtest.plan.profile_engine", lambda engine: StepModel(
        DecodeTable((1,), (next(timed) * MS,), (0.0,)), Linear(MS, 0.0, 0.0), 0.0))
    with contextlib.chdir(cpu_tiny_project), skipped_compute(7.0, 0.7):
        spec = load_spec(Path("configs/cpu-tiny.yaml"))
        first = {role: m.decode_s(1, 0) for role, m in profiles(spec).items()}
        cached = {role: m.decode_s(1, 0) for role, m in profiles(spec).items()}
        again = {role: m.decode_s(1, 0) for role, m in profiles(spec, again=True).items()}
        after = {role: m.decode_s(1, 0) for role, m in profiles(spec).items()}
    assert sorted(first.values()) == pytest.approx([MS, 2 * MS, 3 * MS]) and cached == first
    assert sorted(again.values()) == pytest.approx([4 * MS, 5 * MS, 6 * MS]) and after == again
    assert capsys.readouterr().out.count("plan: profiling the") == 6


def test_the_speed_probe_reads_how_much_slower_the_engine_steps_now(cpu_tiny_project):
    """Stand-in steps of 4 ms, then of 8 ms: the machine read as twice as slow as when the probe was made."""
    with skipped_compute(4.0):
        probe = SpeedProbe(cpu_tiny_project / "build" / "engines" / "decode")
    assert probe.reference >= (PROBE_STEPS + 1) * 0.004  # its prompt's steps and the decodes', 4 ms each at least
    assert probe.slowdown() == pytest.approx(1.0, abs=0.1)
    probe.profiler.engine.model.step_s = 0.008
    assert probe.slowdown() == pytest.approx(2.0, abs=0.2)


def test_a_slower_machine_stretches_the_planner_s_steps_and_front_alike():
    steps = StepModel(DecodeTable((1, 8), (4 * MS, 10 * MS), (6e-6, 5e-6)), Linear(2 * MS, 170e-6, 1e-9), 0.1)
    limits = EngineLimits(8, 64, True, 16)
    planner = Planner({"prefill": steps, "decode": steps}, {"prefill": limits, "decode": limits}, lambda n: 0.001 * n,
                      {"disaggregated": Host(2.0, 0.5 * MS)}, latency_s={"disaggregated": 0.03})
    slower = planner.slower(1.5)
    assert slower.steps["decode"].decode_s(4, 500.0) == pytest.approx(1.5 * steps.decode_s(4, 500.0))
    assert slower.hosts["disaggregated"].front_s_per_token == pytest.approx(0.75 * MS)
    assert slower.latency_s == planner.latency_s and slower.handoff_s(10) == planner.handoff_s(10)  # hops, not compute


def _sample(model: str, t_send: float, prompt: int, tokens: int) -> Sample:
    return Sample(model, 0, prompt, tokens, False, 2.0, 8, None, 0.0, t_send, tuple(t_send + 0.01 * i for i in range(tokens)),
                  (1,) * tokens, t_send + 0.1)


def test_check_replays_each_measured_run_s_own_requests(tmp_path, capsys):
    # a measured run's two requests, sent 0.5 s apart (perf_counter stamps), 3 tokens each
    point = {"prompt_tokens": 32, "rate": 2.0, "samples": {}}
    for model, deployment in (("aggregated", "aggregated"), ("ensemble", "disaggregated")):
        path = tmp_path / f"{deployment}.jsonl"
        path.write_text("".join(s.to_json() + "\n" for s in (_sample(model, 100.0, 16, 3), _sample(model, 100.5, 32, 3))))
        point["samples"][deployment] = path.name
        point[deployment] = {"ttft_ms": {"p50": 2.0}, "itl_ms": {"p95": 1.0}, "slo_attainment": 1.0}
    (tmp_path / "crossover.json").write_text(json.dumps({"points": [point]}))
    limits = {"prefill": EngineLimits(2, 512, False, 16), "decode": EngineLimits(8, 8, True, 16),
              "aggregated": EngineLimits(8, 64, True, 16)}
    planner = Planner({"prefill": FLAT, "decode": FLAT, "aggregated": FLAT}, limits, lambda n: 0.0)
    replayed_requests = replayed(read_samples([tmp_path / "aggregated.jsonl"]))
    assert [(r.arrival, r.prompt, r.output) for r in replayed_requests] == [(0.0, 16, 3), (0.5, 32, 3)]
    check(planner, load_workload("quick"), [tmp_path / "crossover.json"])
    out = capsys.readouterr().out
    # aggregated: each prompt in one 1 ms step, then a token per 1 ms step: TTFT 1 ms against 2 measured
    assert "aggregated x2" in out and "1 |      2 |   -50%" in out
    # disaggregated: prefill step, then the decode engine's import step: TTFT 1 ms, an ITL of 1 ms as measured
    assert "p50 TTFT prediction error: median 50%, worst 50% over 2 runs" in out
    assert "p95 ITL prediction error: median 0%, worst 0% over 2 runs" in out


def test_a_request_that_did_not_finish_is_replayed_whole_and_left_out_of_the_latencies(tmp_path, capsys):
    """It held its engine until the run stopped: replayed with every token it asked for (it delays the next
    one), but the measured latencies have no value of it, so the predicted ones leave it out too."""
    first = dataclasses.replace(_sample("aggregated", 100.0, 16, 1), max_tokens=40, error="unfinished: the run stopped")
    second = _sample("aggregated", 100.001, 16, 3)
    limits = {"aggregated": EngineLimits(1, 64, True, 16)}  # one at a time: the second waits for the first
    planner = Planner({"aggregated": FLAT}, limits, lambda n: 0.0)
    assert [(r.arrival, r.output) for r in replayed([second, first])] == [(0.0, 40), (pytest.approx(0.001), 3)]
    traffic = traffic_of(load_workload("quick"), 2.0, 16)
    p = predicted_run(planner, Deployment(aggregated=1), [second, first], traffic)
    assert p.ttft_p50_s == pytest.approx(0.041 - 0.001)  # after the first's 40 steps of 1 ms, then its own prompt
    assert predicted_run(planner, Deployment(aggregated=1), [first], traffic) is None
    path = tmp_path / "aggregated.jsonl"
    path.write_text(first.to_json() + "\n")
    point = {"prompt_tokens": 16, "rate": 2.0, "samples": {"aggregated": path.name, "disaggregated": path.name}}
    point |= {d: {"ttft_ms": {"p50": None}, "itl_ms": {"p95": None}, "slo_attainment": 0.0} for d in ("aggregated", "disaggregated")}
    (tmp_path / "crossover.json").write_text(json.dumps({"points": [point]}))
    check(Planner({"aggregated": FLAT, "prefill": FLAT, "decode": FLAT}, {**limits, "prefill": limits["aggregated"],
          "decode": limits["aggregated"]}, lambda n: 0.0), load_workload("quick"), [tmp_path / "crossover.json"])
    assert capsys.readouterr().out.count("no request finished in the measured run") == 2


def test_a_decode_overhead_lengthens_every_decode_step_alike_and_leaves_prompt_steps():
    model = StepModel(DecodeTable((1, 8), (4 * MS, 10 * MS), (6e-6, 5e-6)), Linear(2 * MS, 170e-6, 1e-9), 0.1)
    slower = model.with_decode_overhead(3 * MS)
    for batch in (1, 4, 8, 16):  # 3 ms more at every batch size, not a share of the step
        assert slower.decode_s(batch, 900) == pytest.approx(model.decode_s(batch, 900) + 3 * MS)
    assert slower.prefill_s(512) == model.prefill_s(512)
    assert slower.step_s(4, 3600.0, 256, 256 * 128.5) == model.step_s(4, 3600.0, 256, 256 * 128.5)  # a chunk beside decodes
    assert slower.fit_error == model.fit_error
    faster = model.with_decode_overhead(-5 * MS)  # never under a tenth of the profiled step
    assert faster.decode.base_s == pytest.approx((0.4 * MS, 5 * MS))


def test_a_slower_machine_stretches_every_step_by_the_same_factor():
    model = dataclasses.replace(StepModel(DecodeTable((1, 8), (4 * MS, 10 * MS), (6e-6, 5e-6)), Linear(2 * MS, 170e-6, 1e-9), 0.1),
                                per_sequence_s=0.5 * MS, cpu_per_wall=1.1)
    slower = model.slower(1.05)
    for step in ((1, 900.0), (6, 5400.0), (16, 14400.0), (0, 0.0, 512, 512 * 256.5), (4, 3600.0, 256, 256 * 128.5)):
        assert slower.step_s(*step) == pytest.approx(1.05 * model.step_s(*step))
    assert (slower.cpu_per_wall, slower.fit_error) == (1.1, 0.1)  # the cores it keeps busy, as before


def test_a_cost_per_sequence_grows_with_the_batch_and_spares_steps_of_one():
    model = dataclasses.replace(StepModel(DecodeTable((1, 8), (4 * MS, 10 * MS), (6e-6, 5e-6)), Linear(2 * MS, 170e-6, 1e-9), 0.1),
                                per_sequence_s=0.5 * MS)
    plain = dataclasses.replace(model, per_sequence_s=0.0)
    for batch in (1, 4, 8, 16):
        assert model.decode_s(batch, 900) == pytest.approx(plain.decode_s(batch, 900) + (batch - 1) * 0.5 * MS)
    assert model.prefill_s(512) == plain.prefill_s(512)
    assert model.step_s(4, 3600.0, 256, 256 * 128.5) == pytest.approx(plain.step_s(4, 3600.0, 256, 256 * 128.5) + 1.5 * MS)


def test_calibration_finds_the_cost_per_sequence_a_batch_was_served_with():
    """Six requests sent together, served (here: simulated) with 0.4 ms more per step for each generating sequence
    after the first; from their token times alone the search finds that cost again."""
    limits = {"aggregated": EngineLimits(8, 64, False, 16)}
    truth = Planner({"aggregated": dataclasses.replace(FLAT, per_sequence_s=0.4 * MS)}, limits, lambda n: 0.0)
    batch = truth.replay(Deployment(aggregated=1), [SimRequest(0.0, 4, 10 + 5 * i) for i in range(6)])
    samples = [Sample("aggregated", i, 4, r.output, False, None, 6, None, 0.0, 50.0 + r.arrival, tuple(50.0 + t for t in r.token_times),
                      (1,) * r.output, 50.0 + r.token_times[-1]) for i, r in enumerate(batch)]
    planner = Planner({"aggregated": FLAT}, limits, lambda n: 0.0)
    cost, measured, simulated = per_sequence_cost(planner, Deployment(aggregated=1), "aggregated", samples)
    assert cost == pytest.approx(0.4 * MS, rel=0.01)
    assert simulated == pytest.approx(measured, rel=0.01)
    assert measured == pytest.approx(np.median([r.tpot for r in batch]))
    slower = Planner({"aggregated": StepModel(DecodeTable((1,), (4 * MS,), (0.0,)), Linear(4 * MS, 0.0, 0.0), 0.0)}, limits, lambda n: 0.0)
    assert per_sequence_cost(slower, Deployment(aggregated=1), "aggregated", samples)[0] == 0.0  # served faster: no negative cost


def test_calibration_at_load_finds_the_factor_decode_work_was_served_with():
    """Requests arriving one after another on two cores shared with a prefill engine, served (here: simulated) with
    decode work x1.3 and prompts as profiled; from their token times alone the search finds x1.3 again, and a
    planner whose decode work is already that slow finds x1."""
    limits = {"prefill": EngineLimits(4, 512, False, 16), "decode": EngineLimits(8, 64, True, 16)}
    steps = {"prefill": StepModel(DecodeTable((1,), (1 * MS,), (0.0,)), Linear(2 * MS, 0.05 * MS, 0.0), 0.0), "decode": FLAT}
    host = {"disaggregated": Host(cores=2, front_s_per_token=0.2 * MS)}
    deployment = Deployment(prefill=1, decode=1)
    truth = Planner({**steps, "decode": FLAT.decode_scaled(1.3)}, limits, lambda n: 0.0, host)
    served = truth.replay(deployment, [SimRequest(0.02 * i, 64, 12 + i % 5) for i in range(20)])
    samples = [Sample("ensemble", i, 64, r.output, False, None, 20, None, 0.0, 50.0 + r.arrival, tuple(50.0 + t for t in r.token_times),
                      (1,) * r.output, 50.0 + r.token_times[-1]) for i, r in enumerate(served)]
    factor, measured, simulated = decode_factor(Planner(steps, limits, lambda n: 0.0, host), deployment, "decode", samples)
    assert factor == pytest.approx(1.3, abs=0.01)
    assert simulated == pytest.approx(measured, rel=0.01)
    assert decode_factor(truth, deployment, "decode", samples)[0] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("runs, factor", [
    ((1.15,), 1.15),  # near x1: believed
    ((0.80, 0.76), 0.78),  # far, and found again: the mean of the two
    ((1.86, 1.05, 1.12), 1.12),  # far, then not: a third, and the median
    ((1.40, 1.20, 1.45), 1.40),
])
def test_a_factor_at_load_far_from_one_is_served_again_before_it_is_believed(runs, factor):
    served = []

    def factor_of_run(n: int) -> float:
        served.append(n)
        return runs[n]

    found, factors = confirmed(factor_of_run)
    assert found == pytest.approx(factor) and factors == list(runs) and served == list(range(len(runs)))


def test_calibration_at_load_leaves_engines_that_do_not_share_the_cores_as_they_are(tmp_path):
    """Only engines computing on the front's cores slow each other under load: with engines off the CPU (GPU
    stand-ins) or no host simulated, nothing is served and the planner comes back as it was."""
    limits = {"prefill": EngineLimits(4, 512, False, 16), "decode": EngineLimits(8, 64, True, 16)}
    for hosts in ({}, {"disaggregated": Host(cores=2, front_s_per_token=0.2 * MS, engines_on_cpu=False)}):
        planner = Planner({"prefill": FLAT, "decode": FLAT}, limits, lambda n: 0.0, hosts)
        assert fitted_at_load(planner, None, tmp_path / "absent.yaml", tmp_path, "disaggregated", Deployment(prefill=1, decode=1)) is planner
    assert not any(tmp_path.iterdir())


def test_a_fitted_planner_is_written_whole_and_its_steps_read_back_as_fitted():
    """`loadtest splits` records what its predictions rest on; the calibrated parts of a role's steps survive JSON."""
    fitted = dataclasses.replace(FLAT, cpu_per_wall=1.21, per_sequence_s=0.65 * MS)
    planner = Planner({"decode": fitted}, {}, lambda n: 0.0, {"disaggregated": Host(2, 2.3 * MS)}, latency_s={"disaggregated": 0.09})
    state = json.loads(json.dumps(planner.fitted()))
    assert StepModel.from_dict(state["steps"]["decode"]) == fitted
    assert state["hosts"] == {"disaggregated": {"cores": 2, "front_s_per_token": 2.3 * MS, "engines_on_cpu": True, "decode_interference": 0.0}}
    assert state["latency_s"] == {"disaggregated": 0.09}
    assert state["orchestrators"] is None


def test_a_deployment_s_latency_delays_its_tokens_and_holds_no_engine():
    limits = {"aggregated": EngineLimits(8, 64, False, 16)}
    reqs = [SimRequest(0.0, 4, 3), SimRequest(0.0, 4, 3)]
    plain = Planner({"aggregated": FLAT}, limits, lambda n: 0.0).replay(Deployment(aggregated=1), [dataclasses.replace(r, token_times=[]) for r in reqs])
    late = Planner({"aggregated": FLAT}, limits, lambda n: 0.0, latency_s={"aggregated": 0.25}).replay(Deployment(aggregated=1), reqs)
    for p, r in zip(plain, late):
        assert r.token_times == pytest.approx([t + 0.25 for t in p.token_times])
    assert plain[0].token_times == pytest.approx([1 * MS, 2 * MS, 3 * MS])  # both in one batch: the latency queued nothing
    disaggregated = Planner({"prefill": FLAT, "decode": FLAT}, {"prefill": limits["aggregated"], "decode": limits["aggregated"]},
                            lambda n: 0.0, latency_s={"aggregated": 0.25}).replay(Deployment(prefill=1, decode=1), [SimRequest(0.0, 4, 2)])
    assert disaggregated[0].ttft == pytest.approx(1 * MS)  # another kind's latency


def test_the_front_s_cpu_leaves_out_every_engine_model_of_both_deployments(tmp_path):
    """What `bench front` measured by process, in ms per token (one run's figures): the engines' own
    processes, every instance of them, are left to their calibrated steps."""
    spec = split_spec(ROOT / "configs/cpu-tiny.yaml", tmp_path, instances=3, prefill=1)  # decode, decode_1
    measured = {"tritonserver": 0.731, "stub disagg_orchestrator": 0.615, "client": 0.383, "stub postprocessing": 0.302,
                "stub decode_1": 0.29, "stub decode": 0.232, "stub aggregated_engine": 0.197, "stub prefill": 0.081,
                "stub aggregated_orchestrator": 0.023, "stub preprocessing": 0.012}
    assert front_s_per_token(measured, spec) == pytest.approx((0.731 + 0.615 + 0.383 + 0.302 + 0.023 + 0.012) * MS)


@pytest.mark.e2e
def test_calibration_fits_the_planner_to_the_requests_it_served(cpu_tiny_project, tmp_path, capsys):
    """Engines alone (no front in the simulation): every predicted TTFT is prompt steps plus the latency and
    every TPOT decode steps, so after calibration the median of measured minus predicted is 0 for both, for the
    requests served one at a time and, through the cost per generating sequence, for the batch sent at once.
    Ten outputs of 130+ tokens give the decoding engines over a second of steps, long enough to read their CPU;
    the tiny model's prompts take milliseconds, too short, so the prefill engine keeps one core."""
    workload, _ = workload_variant(WORKLOAD_DIR / "quick.yaml", tmp_path, "long", prompt_tokens=[{"weight": 1.0, "min": 8, "max": 16}],
                                   output_tokens=[{"weight": 1.0, "min": 130, "max": 145}],
                                   exact_output_tokens=True)
    with contextlib.chdir(cpu_tiny_project):
        spec, _ = compare_spec(Path("configs/cpu-tiny.yaml"), tmp_path)
        build(spec, log=lambda _line: None)
        planner = Planner({"prefill": FLAT, "decode": FLAT, "aggregated": FLAT}, limits_of(spec), lambda n: 0.0)
        tuned = calibrated(planner, spec, workload, tmp_path / "calibration")
    for kind, deployment in (("aggregated", Deployment(aggregated=2)), ("disaggregated", Deployment(prefill=1, decode=1))):
        assert deployment_of(spec, kind) == deployment  # as the spec serves it: compare_spec gives aggregated both engines
        samples = [s for s in read_samples([tmp_path / "calibration" / "samples" / f"{kind}-1users.jsonl"]) if s.ok and s.tpot]
        assert len(samples) == CALIBRATION_REQUESTS
        before = [planner.replay(deployment, replayed([s]))[0] for s in samples]  # each alone, as it was served
        after = [tuned.replay(deployment, replayed([s]))[0] for s in samples]
        assert np.median([s.ttft - r.ttft for s, r in zip(samples, after)]) == pytest.approx(0.0, abs=1e-9)
        assert np.median([s.tpot - r.tpot for s, r in zip(samples, after)]) == pytest.approx(0.0, abs=1e-9)
        assert np.median([s.ttft / r.ttft for s, r in zip(samples, before)]) != pytest.approx(1.0, rel=0.05)  # 1 ms steps
        assert tuned.latency_s[kind] == pytest.approx(np.median([s.ttft - r.ttft for s, r in zip(samples, before)]))
        batch = sorted(read_samples([tmp_path / "calibration" / "samples" / f"{kind}-24users.jsonl"]), key=lambda s: s.t_send)
        assert len(batch) == 24 and all(s.ok for s in batch)
        together = tuned.replay(deployment, replayed(batch))
        assert np.median([r.tpot for r in together]) == pytest.approx(np.median([s.tpot for s in batch]), rel=0.02)
        alone = tuned.adjusted({role: dataclasses.replace(tuned.steps[role], per_sequence_s=0.0) for role in tuned.steps})
        assert np.median([r.tpot for r in alone.replay(deployment, replayed(batch))]) < 0.9 * np.median([s.tpot for s in batch])
    for role in ("decode", "aggregated"):  # measured: each engine process's CPU over its steps' time
        assert 0.2 < tuned.steps[role].cpu_per_wall < 2.0 and tuned.steps[role].cpu_per_wall != 1.0, (role, tuned.steps[role])
        assert tuned.steps[role].per_sequence_s > 0.0
    assert tuned.steps["prefill"].cpu_per_wall == 1.0 and tuned.steps["prefill"].per_sequence_s == 0.0
    assert "the prefill engine's steps took" in capsys.readouterr().out
