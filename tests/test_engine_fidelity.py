"""The reference engine where a client or the orchestrator sees TensorRT-LLM's executor: the first token of a
generation-only request, the input-length rule and its message, chunked context (engine level; the Triton
model's responses are in test_engine_fidelity_model.py)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from engine_helpers import LIMITS, EngineFactory

from disagg.build.reference import engine_config
from disagg.engine.config import EngineConfig
from disagg.engine.engine import ContextPhase, Request, RequestError, StepOutput
from disagg.spec import parse_spec

# max_num_tokens 32 with 16-token blocks: a 100-token prompt needs 4 steps alone, 6 next to a decode.
SMALL = dataclasses.replace(LIMITS, max_num_tokens=32)
CHUNKED = dataclasses.replace(SMALL, enable_chunked_context=True)


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("fidelity"))


def prompt(n: int, seed: int = 0) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(2, 512, size=n))


def context(engine, req_id: str, p: tuple[int, ...], max_new: int) -> ContextPhase:
    """A context-only request run on `engine`; its first token and KV, then released."""
    first = engine.generate([Request(req_id, p, max_new, "context_only")])[req_id]
    kv = engine.export_kv(req_id)
    assert engine.release(req_id)
    return ContextPhase(first[0], kv)


def run(engine, req_id: str) -> list[StepOutput]:
    """Steps until `req_id` finishes; its results, one per step that produced one."""
    results = []
    while not results or not results[-1].finished:
        results += [o for o in engine.step() if o.req_id == req_id]
    return results


# -- 1. the first token of a generation-only request ---------------------------------------------------
def test_generation_only_returns_the_first_token_again_together_with_the_second(factory):
    """TensorRT-LLM re-adds the context phase's token and counts the tokens sent from the prompt length:
    the first result after the first decode step carries [first, second]."""
    agg, decode = factory.engine(), factory.engine(role="decode")
    p = prompt(40)
    expected = agg.generate([Request("a", p, 6)])["a"]
    ctx = context(agg, "c", p, 6)
    assert ctx.first_token == expected[0]
    decode.add_request(Request("g", p, 6, "generation_only", context=ctx))
    results = run(decode, "g")
    assert [r.tokens for r in results] == [tuple(expected[:2]), *((t,) for t in expected[2:])]
    assert [r.finish_reason for r in results] == [None] * 4 + ["length"]


def test_generation_only_ending_at_once_returns_the_first_token_alone(factory):
    agg, decode = factory.engine(), factory.engine(role="decode")
    p = prompt(40)
    expected = agg.generate([Request("a", p, 6)])["a"]
    ctx = context(agg, "c", p, 6)
    decode.add_request(Request("end", p, 6, "generation_only", end_id=expected[1], context=ctx))
    assert run(decode, "end") == [StepOutput("end", (expected[0],), True, "end_id")]
    decode.add_request(Request("one", p, 1, "generation_only", context=ctx))
    assert decode.step() == [StepOutput("one", (expected[0],), True, "length")]  # no forward pass
    assert decode.blocks.num_used == 0


# -- 2. the input-length rule and its message ------------------------------------------------------------
def test_engine_max_input_len_follows_trtgptmodel():
    assert SMALL.engine_max_input_len == 32  # min(max_seq_len - 1, max_num_tokens)
    assert CHUNKED.engine_max_input_len == 319  # max_seq_len - 1
    assert LIMITS.engine_max_input_len == 319


@pytest.mark.parametrize("request_type", ["context_and_generation", "context_only", "generation_only"])
def test_every_request_type_is_refused_over_the_max_input_len_in_tensorrt_llm_words(factory, request_type):
    small, agg = factory.engine(limits=SMALL, role="small"), factory.engine()
    p = prompt(33)
    ctx = context(agg, "c", p, 4) if request_type == "generation_only" else None
    with pytest.raises(RequestError) as err:
        small.add_request(Request("r", p, 4, request_type, context=ctx))
    assert str(err.value) == (
        "Encountered an error when fetching new request: Prompt length (33) exceeds maximum input length (32). "
        "Set log level to info and check TRTGptModel logs for how maximum input length is set"
    )
    small.validate(Request("fits", p[:32], 4, request_type, context=context(agg, "c32", p[:32], 4) if ctx else None))


def test_enable_chunked_context_is_written_by_the_build_and_absent_reads_as_off(factory, tmp_path):
    raw = yaml.safe_load((Path(__file__).parent.parent / "configs/cpu-tiny.yaml").read_text())
    raw["model"] = {"path": str(factory.checkpoint)}
    spec = parse_spec(raw)
    assert spec.roles["decode"].enable_chunked_context and not spec.roles["prefill"].enable_chunked_context
    assert engine_config(spec, spec.roles["decode"]).build.enable_chunked_context
    assert not engine_config(spec, spec.roles["prefill"]).build.enable_chunked_context
    old = json.loads(EngineConfig("decode", factory.config, engine_config(spec, spec.roles["decode"]).mapping, CHUNKED).to_json())
    del old["build_config"]["enable_chunked_context"]  # an engine built before the key existed
    (tmp_path / "config.json").write_text(json.dumps(old))
    assert EngineConfig.load(tmp_path).build == dataclasses.replace(CHUNKED, enable_chunked_context=False)


# -- 3. chunked context -------------------------------------------------------------------------------------
LONG = [prompt(n, seed=n) for n in (33, 100, 250, 300)]


def test_chunked_prompts_give_the_tokens_of_whole_prompts(factory):
    """Prompts several chunks long, alone and all at once (first come, first served, next to decodes)."""
    big, chunked = factory.engine(), factory.engine(limits=CHUNKED, role="chunked")
    expected = {f"r{i}": big.generate([Request(f"r{i}", p, 12)])[f"r{i}"] for i, p in enumerate(LONG)}
    assert {f"r{i}": chunked.generate([Request(f"r{i}", p, 12)])[f"r{i}"] for i, p in enumerate(LONG)} == expected
    assert chunked.generate([Request(f"r{i}", p, 12) for i, p in enumerate(LONG)]) == expected
    assert chunked.blocks.num_used == 0
    with pytest.raises(RequestError, match=r"Prompt length \(320\) exceeds maximum input length \(319\)"):
        chunked.add_request(Request("x", prompt(320), 1))


def test_chunked_context_only_hands_over_kv_that_continues_exactly(factory):
    big, chunked, decode = factory.engine(), factory.engine(limits=CHUNKED, role="chunked"), factory.engine(role="decode")
    for i, p in enumerate(LONG):
        expected = big.generate([Request(f"a{i}", p, 10)])[f"a{i}"]
        ctx = context(chunked, f"c{i}", p, 10)
        assert ctx.kv.num_tokens == len(p) and ctx.first_token == expected[0]
        assert decode.generate([Request(f"g{i}", p, 10, "generation_only", context=ctx)])[f"g{i}"] == expected
    chunked_decode = factory.engine(limits=CHUNKED, role="chunked-decode")  # and imported into a chunked engine
    ctx = context(chunked, "c", LONG[3], 10)
    expected = big.generate([Request("a", LONG[3], 10)])["a"]
    assert chunked_decode.generate([Request("g", LONG[3], 10, "generation_only", context=ctx)])["g"] == expected


def test_a_long_prompt_alone_is_prefilled_in_max_num_tokens_chunks(factory):
    chunked = factory.engine(limits=CHUNKED, role="chunked")
    chunked.add_request(Request("long", LONG[1], 4))
    cached = []
    while not chunked.step():
        cached.append(chunked.running["long"].num_cached)
    assert cached == [32, 64, 96]  # then the last 4 tokens, and the first token


def test_a_running_decode_gets_a_token_every_step_while_a_long_prompt_is_chunked_in(factory):
    chunked, big = factory.engine(limits=CHUNKED, role="chunked"), factory.engine()
    short = prompt(5, seed=1)
    alone = {"d": big.generate([Request("d", short, 30)])["d"], "long": big.generate([Request("long", LONG[1], 4)])["long"]}
    chunked.add_request(Request("d", short, 30))
    got = {"d": [t for o in chunked.step() for t in o.tokens], "long": []}
    chunked.add_request(Request("long", LONG[1], 4))
    cached = []
    for _ in range(6):  # 31 tokens left by the decode: chunks of 16 (a multiple of tokens_per_block), then the 20 left
        outputs = {o.req_id: o for o in chunked.step()}
        assert len(outputs["d"].tokens) == 1
        got["d"] += outputs["d"].tokens
        if "long" in outputs:
            got["long"] += outputs["long"].tokens
        else:
            cached.append(chunked.running["long"].num_cached)
    assert cached == [16, 32, 48, 64, 80] and len(got["long"]) == 1
    while chunked.has_work():
        for o in chunked.step():
            got[o.req_id] += o.tokens
    assert got == alone and chunked.blocks.num_used == 0


def test_without_chunked_context_a_prompt_runs_whole_or_waits(factory):
    small = factory.engine(limits=SMALL, role="small")
    small.add_request(Request("d", prompt(5, seed=1), 8))
    small.step()
    small.add_request(Request("p", prompt(32, seed=2), 4))  # 32 > the 31 tokens the decode leaves
    small.step()
    assert [s.req_id for s in small.waiting] == ["p"]
    while small.has_work():
        small.step()
    assert small.blocks.num_used == 0
