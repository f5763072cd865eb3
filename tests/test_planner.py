"""The planner: step-model fit, the simulated schedule step by step, the split search, a profiled engine."""
from __future__ import annotations

import pytest

from disagg.planner.plan import Planner, Traffic, predict
from disagg.planner.profile import Linear, StepModel, fit, profile_engine
from disagg.planner.simulate import Deployment, EngineLimits, Host, SimRequest, simulate

MS = 1e-3
FLAT = StepModel(Linear(1 * MS, 0.0, 0.0), Linear(1 * MS, 0.0, 0.0), 0.0)  # every step 1 ms


def test_fit_recovers_the_step_model_it_was_sampled_from():
    truth = StepModel(decode=Linear(4 * MS, 1e-6, 60e-9), prompt=Linear(2 * MS, 170e-6, 0.8e-9), fit_error=0.0)
    prompt = [(n, n * (n + 1) / 2, truth.prefill_s(n)) for n in (16, 256, 1024)]
    prompt += [(64, 64 * (o + 32.5), truth.step_s(64, 64 * (o + 32.5), True)) for o in (0, 512, 1536)]
    decode = [(b, b * c, truth.decode_s(b, c)) for b in (1, 8, 32) for c in (100, 1000)]
    got = fit(decode, prompt)
    for part in ("decode", "prompt"):
        for coef in ("base_s", "per_token_s", "per_attended_s"):
            assert getattr(getattr(got, part), coef) == pytest.approx(getattr(getattr(truth, part), coef), rel=1e-6)
    assert got.fit_error < 1e-9
    assert StepModel.from_dict({"decode": vars(truth.decode), "prompt": vars(truth.prompt), "fit_error": 0.0}) == truth


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
    steps = {"prefill": StepModel(Linear(0.0, 0.0, 0.0), Linear(0.0, 0.1 * MS, 0.0), 0.0), "decode": FLAT}
    req = SimRequest(0.0, 200, 4)
    simulate(Deployment(prefill=1, decode=1), steps, limits, [req], lambda n: n * 0.01 * MS)
    # prefill 200 x 0.1 ms = 20 ms (first token), handoff 2 ms, then a token per 1 ms decode step
    assert req.token_times == pytest.approx([20 * MS, 23 * MS, 24 * MS, 25 * MS])


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


def test_engines_off_the_cpu_leave_the_front_its_cores():
    limits = {"aggregated": EngineLimits(max_batch_size=4, max_num_tokens=32, chunked=True, tokens_per_block=16)}
    req = SimRequest(0.0, prompt=16, output=3)
    simulate(Deployment(aggregated=1), {"aggregated": FLAT}, limits, [req], lambda n: 0.0,
             Host(cores=2, front_s_per_token=0.5 * MS, engines_on_cpu=False))
    assert req.token_times == pytest.approx([1.25 * MS, 2.25 * MS, 3.25 * MS])  # 0.5 ms of CPU over 2 cores


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
    model = StepModel(Linear(5 * MS, 0.05 * MS, 0.0), Linear(5 * MS, 0.5 * MS, 1e-7), 0.0)  # a long prompt: tens of decode steps
    limits = {"prefill": EngineLimits(2, 2048, False, 32), "decode": EngineLimits(32, 64, True, 32),
              "aggregated": EngineLimits(32, 256, True, 32)}
    return Planner({"prefill": model, "decode": model, "aggregated": model}, limits, lambda n: 0.0, requests=150)


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


def test_profile_of_the_tiny_engine_fits_its_steps(cpu_tiny_project):
    model = profile_engine(cpu_tiny_project / "build" / "engines" / "aggregated", progress=False)
    # Sub-millisecond steps on a shared 2-core machine are noisy: only what no noise can turn around.
    assert model.prefill_s(256) > 4 * model.decode_s(1, 16)
