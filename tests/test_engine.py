"""Reference engine oracles: disaggregated == aggregated, sharded == unsharded, batched == alone."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import LIMITS, EngineFactory

from disagg.engine.engine import ContextPhase, Request, RequestError, StepOutput
from disagg.engine.kv_cache import KVCacheFullError
from disagg.engine.kv_wire import SequenceKV
from disagg.engine.sampling import NO_END_ID, SamplingParams, mask_end_id

GRID = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("engines"))


def prompts(n: int, vocab: int = 512, seed: int = 7) -> list[tuple[int, ...]]:
    """Varied lengths: 1 token, under a block, exactly a block, over a block, several blocks, the limit."""
    rng = np.random.default_rng(seed)
    lengths = [1, 5, 15, 16, 17, 31, 33, 48, 64, 100, 127, 128, 129, 150, 200, 255, LIMITS.max_input_len]
    lengths += list(rng.integers(2, 120, size=max(0, n - len(lengths))))
    return [tuple(int(t) for t in rng.integers(2, vocab, size=n_tok)) for n_tok in lengths[:n]]


def disaggregated(prefill, decode, req_id, prompt, max_new, sampling=SamplingParams(), end_id=None, wire=True):
    """context_only on `prefill`, KV through the wire format, generation_only on `decode`: decode's tokens,
    which start with the context phase's token again (TensorRT-LLM's generation-only request returns it)."""
    first = prefill.generate([Request(req_id, prompt, max_new, "context_only", sampling, end_id)])[req_id]
    if req_id not in prefill.held:  # the context phase ended the request (end_id, max_new 1): nothing kept
        return first
    kv = prefill.export_kv(req_id)
    if wire:
        kv = SequenceKV.from_bytes(kv.to_bytes())
    assert prefill.release(req_id)
    ctx = ContextPhase(first[0], kv)
    tokens = decode.generate([Request(req_id, prompt, max_new, "generation_only", sampling, end_id, ctx)])[req_id]
    assert tokens[:1] == first
    return tokens


def test_disaggregated_equals_aggregated_for_20_prompts(factory):
    agg, prefill, decode = factory.engine(), factory.engine(role="prefill"), factory.engine(role="decode")
    ps = prompts(22)
    assert max(map(len, ps)) == LIMITS.max_input_len and any(len(p) > LIMITS.tokens_per_block for p in ps)
    for i, p in enumerate(ps):
        max_new = min(24, LIMITS.max_seq_len - len(p))
        expected = agg.generate([Request(f"a{i}", p, max_new)])[f"a{i}"]
        assert len(expected) == max_new
        assert disaggregated(prefill, decode, f"d{i}", p, max_new) == expected, f"prompt {i} ({len(p)} tokens)"
    for engine in (agg, prefill, decode):
        assert engine.blocks.num_used == 0


@pytest.mark.parametrize("prefill_tp_pp", GRID, ids=lambda g: f"prefill-tp{g[0]}pp{g[1]}")
def test_sharded_roles_equal_unsharded(factory, prefill_tp_pp):
    agg = factory.engine()
    prefill = factory.engine(*prefill_tp_pp, role="prefill")
    ps = prompts(3, seed=11)
    expected = {i: agg.generate([Request(f"a{i}", p, 12)])[f"a{i}"] for i, p in enumerate(ps)}
    for tp_pp in GRID:
        decode = factory.engine(*tp_pp, role="decode")
        for i, p in enumerate(ps):
            got = disaggregated(prefill, decode, f"{tp_pp}-{i}", p, 12)
            assert got == expected[i], f"prefill tp/pp {prefill_tp_pp} -> decode tp/pp {tp_pp}, prompt {i}"
        assert decode.blocks.num_used == 0
    for tp_pp in GRID:  # and aggregated engines of every sharding
        sharded = factory.engine(*tp_pp)
        assert sharded.generate([Request("s", ps[0], 12)])["s"] == expected[0], f"aggregated tp/pp {tp_pp}"


def test_batched_decode_equals_each_alone(factory):
    engine = factory.engine()
    ps = prompts(9, seed=3)[1:9]
    assert len({len(p) for p in ps}) == 8
    alone = {f"r{i}": engine.generate([Request(f"r{i}", p, 10 + i)])[f"r{i}"] for i, p in enumerate(ps)}
    batched = engine.generate([Request(f"r{i}", p, 10 + i) for i, p in enumerate(ps)])
    assert batched == alone
    assert engine.blocks.num_used == 0


def test_in_flight_batching_admits_new_requests_mid_decode(factory):
    engine = factory.engine()
    p1, p2 = prompts(3, seed=5)[1:3]
    alone = engine.generate([Request("b", p2, 6)])["b"]
    engine.add_request(Request("a", p1, 20))
    for _ in range(5):
        engine.step()
    engine.add_request(Request("b", p2, 6))
    tokens = []
    while engine.has_work():
        tokens += [t for o in engine.step() if o.req_id == "b" for t in o.tokens]
    assert tokens == alone


def test_seeded_sampling_is_reproducible_and_splits_across_roles(factory):
    agg, prefill, decode = factory.engine(), factory.engine(role="prefill"), factory.engine(2, 1, role="decode")
    p = prompts(5, seed=9)[4]
    s1 = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234)
    a = agg.generate([Request("x", p, 16, sampling=s1)])["x"]
    assert a == agg.generate([Request("y", p, 16, sampling=s1)])["y"]
    assert disaggregated(prefill, decode, "z", p, 16, sampling=s1) == a
    other = agg.generate([Request("w", p, 16, sampling=SamplingParams(0.9, 40, 0.95, seed=99))])["w"]
    assert other != a
    greedy = agg.generate([Request("g", p, 16)])["g"]
    assert a != greedy


def test_end_id_stops_generation(factory):
    engine = factory.engine()
    p = prompts(5, seed=1)[3]
    full = engine.generate([Request("f", p, 12)])["f"]
    stop = full[4]
    cut = engine.generate([Request("e", p, 12, end_id=stop)])["e"]
    assert cut == full[: full.index(stop)]
    assert engine.blocks.num_used == 0


def test_min_tokens_keeps_end_id_out_until_that_many_tokens_in_every_deployment(factory):
    """TensorRT-LLM's min length (penaltyKernels.cu batchApplyPenalty): end_id's logit is masked while fewer
    than min_tokens new tokens exist. Here end_id is the greedy first token, so without min_tokens the answer
    is empty. A generation-only request counts the context phase's token as generated: off by one, decode
    would mask one step too many and the disaggregated answer would run longer."""
    agg, prefill, decode = factory.engine(), factory.engine(role="prefill"), factory.engine(2, 1, role="decode")
    p = prompts(5, seed=3)[3]
    end_id = agg.generate([Request("g", p, 24)])["g"][0]
    assert agg.generate([Request("e", p, 24, end_id=end_id)])["e"] == []
    answers = {}
    for m in range(12):
        got = agg.generate([Request(f"m{m}", p, 24, sampling=SamplingParams(min_tokens=m), end_id=end_id)])[f"m{m}"]
        assert len(got) >= m and end_id not in got
        assert disaggregated(prefill, decode, f"d{m}", p, 24, SamplingParams(min_tokens=m), end_id) == got, m
        answers[m] = got
    assert len(answers[5]) >= 5
    # end_id ends the answer as soon as the mask lifts where greedy picks it: a longer minimum only extends it
    ended = [m for m, got in answers.items() if len(got) < 24]
    assert any(len(answers[m]) == m for m in ended if m > 0)
    for m in ended:
        longer = answers.get(len(answers[m]) + 1)
        if longer is not None:
            assert len(longer) > len(answers[m]) and longer[: len(answers[m])] == answers[m]
    # per request: batched with requests that have none, each gets what it gets alone
    batch = [Request("b5", p, 24, sampling=SamplingParams(min_tokens=5), end_id=end_id), Request("b0", p, 24, end_id=end_id)]
    assert agg.generate(batch) == {"b5": answers[5], "b0": []}
    sampled = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=5, min_tokens=3)
    free = agg.generate([Request("s", p, 24, sampling=dataclasses.replace(sampled, min_tokens=0))])["s"]
    got = agg.generate([Request("s3", p, 24, sampling=sampled, end_id=free[1])])["s3"]
    assert len(got) >= 3 and disaggregated(prefill, decode, "ds3", p, 24, sampled, free[1]) == got
    for engine in (agg, prefill, decode):
        assert engine.blocks.num_used == 0


def test_end_id_minus_one_is_ignore_eos_in_every_deployment(factory):
    """TensorRT-LLM serves `ignore_eos` as end_id -1: no token ends the request, only max_new_tokens. The
    greedy first token, which ends the answer at once as end_id, is generated like any other."""
    agg, prefill, decode = factory.engine(), factory.engine(role="prefill"), factory.engine(2, 1, role="decode")
    p = prompts(5, seed=3)[3]
    free = agg.generate([Request("g", p, 24)])["g"]
    assert agg.generate([Request("e", p, 24, end_id=free[0])])["e"] == []
    got = agg.generate([Request("n", p, 24, end_id=NO_END_ID)])["n"]
    assert got == free and len(got) == 24
    assert disaggregated(prefill, decode, "d", p, 24, SamplingParams(), NO_END_ID) == got
    assert mask_end_id(np.zeros(3, dtype=np.float32), NO_END_ID, generated=0, min_tokens=3)[-1] == 0.0
    for engine in (agg, prefill, decode):
        assert engine.blocks.num_used == 0


def test_mask_end_id_is_the_min_length_penalty():
    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)
    assert mask_end_id(logits, 1, generated=2, min_tokens=3)[1] == -np.inf  # 2 of 3: still masked
    assert mask_end_id(logits, 1, generated=3, min_tokens=3) is logits  # the 4th token may be end_id
    assert mask_end_id(logits, None, generated=0, min_tokens=3) is logits  # no end_id, nothing to mask
    assert logits[1] == 5.0  # the engine's logits are not written


def test_kv_pool_returns_to_zero_after_aborts(factory):
    engine = factory.engine(limits=LIMITS)
    ps = prompts(6, seed=2)
    for i, p in enumerate(ps):
        engine.add_request(Request(f"q{i}", p, 30, "context_only" if i == 0 else "context_and_generation"))
    engine.step()
    engine.step()
    assert engine.blocks.num_used > 0
    assert "q0" in engine.held
    for i in range(len(ps)):
        assert engine.abort(f"q{i}")
    assert not engine.abort("q0")
    assert engine.blocks.num_used == 0 and not engine.has_work()


def test_waiting_requests_queue_until_blocks_free(factory):
    from disagg.engine.config import BuildConfig

    small = BuildConfig(16, 256, 320, 1024, 16, kv_cache_blocks=20)  # 320 tokens: exactly one full-length sequence
    engine = factory.engine(limits=small)
    p = prompts(2, seed=4)[1]
    engine.add_request(Request("big", p, 320 - len(p)))
    engine.add_request(Request("next", p, 4))
    engine.step()
    assert [s.req_id for s in engine.waiting] == ["next"]
    with pytest.raises(KVCacheFullError, match=r"needs 1 blocks for 5 tokens, 0 of 20 free"):
        engine.blocks.allocate("x", 5)
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_used == 0


@pytest.mark.parametrize(
    "request_kwargs, message",
    [
        (dict(prompt_ids=()), "input_ids: empty prompt"),
        (dict(prompt_ids=(5,) * 320), r"Prompt length \(320\) exceeds maximum input length \(319\)"),
        (dict(prompt_ids=(5, 9999)), r"input_ids: token id 9999 outside the vocabulary \[0, 512\)"),
        (dict(max_new_tokens=0), "request_output_len: 0 must be >= 1"),
        (dict(max_new_tokens=400), "request_output_len: prompt 3 \\+ 400 new tokens is over the limit max_seq_len=320"),
        (dict(request_type="context"), "request_type: 'context' is not one of"),
        (dict(request_type="generation_only"), "context_phase_params: required for a generation_only request"),
        (dict(sampling=SamplingParams(top_p=1.5)), r"runtime_top_p: 1.5 must be in \[0, 1\]"),
        (dict(end_id=-2), r"end_id: -2 outside the vocabulary \[0, 512\) and not -1"),
        (dict(sampling=SamplingParams(min_tokens=-1)), "min_tokens: -1 must be >= 0"),
    ],
)
def test_bad_requests_are_refused_with_the_field_named(factory, request_kwargs, message):
    engine = factory.engine()
    req = dict(req_id="bad", prompt_ids=(5, 6, 7), max_new_tokens=4) | request_kwargs
    with pytest.raises(RequestError, match=message):
        engine.add_request(Request(**req))
    assert not engine.has_work() and engine.blocks.num_used == 0


def test_context_only_that_already_finished_keeps_no_kv(factory):
    """max_new_tokens=1, or a first token that is end_id (not returned): the request completes in the context
    phase, before the cache transceiver would take it (TensorRT-LLM's updateRequests marks it complete)."""
    prefill = factory.engine(role="prefill")
    p = prompts(3, seed=8)[2]
    first = prefill.generate([Request("one", p, 1, "context_only")])["one"]
    assert len(first) == 1 and not prefill.held and prefill.blocks.num_used == 0
    prefill.add_request(Request("end", p, 8, "context_only", end_id=first[0]))
    assert prefill.step() == [StepOutput("end", (), True, "end_id")]
    assert not prefill.held and prefill.blocks.num_used == 0
