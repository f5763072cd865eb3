"""The OpenAI-compatible API (disagg/openai) in front of a real tritonserver, driven by the official
`openai` client: answers equal the ensembles' and transformers', usage is exact, stop sequences, errors in
OpenAI's format naming the field, and a client that goes away cancels the generation and frees its KV.
"""
from __future__ import annotations

import http.client
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from disagg.checkpoint import BOS
from disagg.openai.chat_template import ChatTemplate
from disagg.openai.deployment import Deployment
from disagg.serve.openai_front import OpenAIFront
from disagg.triton.preprocessing import Limits, Preprocessor
from tests.e2e_helpers import busy, cancelled_total, cancels_after, wait_kv_zero
from tools.stream_client import stream

# "had not": the tiny model's greedy answer ends on EOS after 19 tokens (finish_reason "stop")
PROMPTS = ["It was the best of times", "had not", "def forward(self, x):\n    return x", "Unicode: café naïve 東京 ✓"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
CHAT_ENDING = [{"role": "user", "content": "was"}]  # answered with 11 tokens, then EOS
NO_KV = {"prefill": 0, "decode": 0, "aggregated": 0}


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    s = start_triton(cpu_tiny_project / "model_repository")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def front(server, cpu_tiny_project, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai") / "openai.log"
    with OpenAIFront(cpu_tiny_project / "model_repository", server.grpc_url, log_path=log) as f:
        yield f


@pytest.fixture(scope="module")
def client(front) -> openai.OpenAI:
    return openai.OpenAI(base_url=front.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def hf(cpu_tiny_project):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = cpu_tiny_project / "build/checkpoints/tiny-llama"
    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def greedy(ids: list[int], max_new: int) -> tuple[str, int]:
        """transformers' greedy continuation: its text and how many tokens it has before EOS."""
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new, pad_token_id=tok.eos_token_id)
        new = out[0, len(ids):].tolist()
        new = new[: new.index(tok.eos_token_id)] if tok.eos_token_id in new else new
        return tok.decode(new, skip_special_tokens=True), len(new)

    return tok, greedy


def chat_ids(tok, chat: list[dict] = CHAT) -> list[int]:
    """transformers' apply_chat_template(tokenize=True): a list (4.x) or a BatchEncoding (5.x)."""
    enc = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if hasattr(enc, "keys") else enc)


def test_models_are_the_two_ensembles(client):
    assert [m.id for m in client.models.list().data] == ["ensemble", "aggregated"]
    assert client.models.retrieve("aggregated").owned_by == "disagg"
    with pytest.raises(openai.NotFoundError, match="The model 'gpt-4' does not exist"):
        client.models.retrieve("gpt-4")


@pytest.mark.parametrize("model", ["ensemble", "aggregated"])
def test_greedy_completions_equal_transformers_with_exact_usage(client, hf, model):
    tok, greedy = hf
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        text, n = greedy(ids, 24)
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
        assert out.choices[0].text == text, prompt
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)
        assert out.choices[0].finish_reason == ("length" if n == 24 else "stop")
        pieces = list(client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == text
        assert pieces[-1].choices[0].finish_reason == out.choices[0].finish_reason


@pytest.mark.parametrize("chat", [CHAT, CHAT_ENDING])
def test_chat_uses_the_checkpoint_template_as_transformers_does(client, hf, cpu_tiny_project, chat):
    tok, greedy = hf
    ids = chat_ids(tok, chat)
    text, n = greedy(ids, 16)
    deployment = Deployment.load(cpu_tiny_project / "model_repository")
    sent = deployment.chat_prompt(chat, add_generation_prompt=True)
    assert deployment.pre.prepare(sent.encode(), 8).input_ids.tolist() == ids
    for model in ("ensemble", "aggregated"):
        out = client.chat.completions.create(model=model, messages=chat, max_completion_tokens=16, temperature=0)
        assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
        assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), n)
        assert out.choices[0].finish_reason == ("length" if n == 16 else "stop")
        chunks = list(client.chat.completions.create(model=model, messages=chat, max_tokens=16, temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-2].choices[0].finish_reason == out.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
        assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_counts_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (AIPerf --per-chunk-usage): each chunk has the usage so far."""
    chunks = list(client.completions.create(model="ensemble", prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 12
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_chat_without_a_limit_may_fill_the_sequence(client, hf):
    """No max_tokens: as many as max_seq_len leaves after the prompt, within max_output_len (319 here)."""
    out = client.chat.completions.create(model="ensemble", messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    prompt = out.usage.prompt_tokens
    assert out.usage.completion_tokens == min(319, 320 - prompt) and out.choices[0].finish_reason == "length"


def test_ignore_eos_and_min_tokens_fix_the_length(client):
    """What benchmark clients send for fixed output lengths: ignore_eos (end_id -1 to the ensemble) and
    min_tokens. The greedy answer to this prompt ends on EOS early without them."""
    prompt = "had not"
    free = client.completions.create(model="ensemble", prompt=prompt, max_tokens=64, temperature=0)
    assert free.usage.completion_tokens < 64 and free.choices[0].finish_reason == "stop"
    for model in ("ensemble", "aggregated"):
        fixed = client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0, extra_body={"ignore_eos": True})
        assert fixed.usage.completion_tokens == 64 and fixed.choices[0].finish_reason == "length"
        assert fixed.choices[0].text.startswith(free.choices[0].text)
        at_least = client.completions.create(model=model, prompt=prompt, max_tokens=64, temperature=0,
                                             extra_body={"min_tokens": free.usage.completion_tokens + 3})
        assert at_least.usage.completion_tokens >= free.usage.completion_tokens + 3


def test_stop_sequences_end_the_answer_before_them_and_free_the_rest(client, server):
    prompt = PROMPTS[0]
    full = client.completions.create(model="ensemble", prompt=prompt, max_tokens=48, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[20:23]
    expected = full[: full.index(stop)]
    for model in ("ensemble", "aggregated"):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0, stop=[stop, "never seen"],
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
        assert out.usage.completion_tokens < 48
        pieces = list(client.completions.create(model=model, prompt=prompt, max_tokens=48, temperature=0, stop=stop,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(p.choices[0].text for p in pieces) == expected
        assert pieces[-1].choices[0].finish_reason == "stop"
    assert wait_kv_zero(server) == NO_KV


def test_seeded_sampling_equals_the_ensemble_and_unseeded_requests_differ(client, server):
    prompt = PROMPTS[1]
    sampled = {m: client.completions.create(model=m, prompt=prompt, max_tokens=24, temperature=0.8, top_p=0.9, seed=7,
                                            extra_body={"ignore_eos": True}).choices[0].text for m in ("ensemble", "aggregated")}
    direct = stream(server.grpc_url, "ensemble", prompt, 24, temperature=0.8, top_p=0.9, seed=7, end_id=-1).text
    assert sampled["ensemble"] == sampled["aggregated"] == direct
    unseeded = {client.completions.create(model="ensemble", prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
                for _ in range(3)}
    assert len(unseeded) > 1  # OpenAI's default is to sample, with a fresh seed each time


def test_a_body_over_4_mb_is_refused_unparsed(front):
    conn = _raw_post(front, "/v1/completions", {"model": "ensemble", "prompt": "word " * 1_000_000})
    resp = conn.getresponse()
    body = json.loads(resp.read())
    conn.close()
    assert resp.status == 413 and body["error"]["message"] == "the request body is 5000035 bytes, over the limit 4194304"


def test_echo_returns_the_prompt_first(client):
    plain = client.completions.create(model="ensemble", prompt="Call me Ishmael.", max_tokens=8, temperature=0)
    echoed = client.completions.create(model="ensemble", prompt="Call me Ishmael.", max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == "Call me Ishmael." + plain.choices[0].text


@pytest.mark.parametrize(
    "kwargs, status, message, param",
    [
        (dict(max_tokens=5000), 400, "max_tokens: 5000 is over the limit 319", "max_tokens"),
        (dict(prompt="word " * 400), 400, "prompt: prompt is 802 tokens, over the limit max_input_len=256", "prompt"),
        (dict(prompt=""), 400, "prompt: empty prompt", "prompt"),
        (dict(n=2), 400, "n: Input should be 1", "n"),
        (dict(temperature=3.5), 400, "temperature: Input should be less than or equal to 2", "temperature"),
        (dict(logprobs=2), 400, "logprobs is not supported by this deployment", "logprobs"),
        (dict(presence_penalty=0.5), 400, "presence_penalty: 0.5 is not supported by this deployment", "presence_penalty"),
        (dict(stop=["a", "b", "c", "d", "e"]), 400, "stop: 5 sequences, at most 4", "stop"),
        (dict(extra_body={"min_tokens": 50}), 400, "min_tokens: 50 is over max_tokens=16", "min_tokens"),
        (dict(extra_body={"top_k": 100000}), 400, "top_k: 100000 is over the vocabulary size 512", "top_k"),
        (dict(extra_body={"best_model": "yes"}), 400, "Unrecognized request argument supplied: best_model", "best_model"),
        (dict(extra_body={"service_class": "gold"}), 400,
         "service_class: 'gold' is not a service class of this deployment (none: orchestrator.service_classes is not set)", "service_class"),
        (dict(model="gpt-4"), 404, "The model 'gpt-4' does not exist (served: ensemble, aggregated)", "model"),
    ],
)
def test_bad_requests_get_openai_errors_naming_the_field(client, kwargs, status, message, param):
    request = dict(model="ensemble", prompt="hello") | kwargs
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**request)
    assert err.value.status_code == status
    assert message in err.value.body["message"], err.value.body
    assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    assert client.completions.create(model="ensemble", prompt="hello", max_tokens=4, temperature=0).usage.completion_tokens >= 1


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "tool", "content": "42"}], "Conversation roles must be system, user or assistant, not tool"),
        ([], "messages: List should have at least 1 item"),
        ([{"role": "user", "content": "word " * 400}], "messages: prompt is 824 tokens, over the limit max_input_len=256"),
    ],
)
def test_bad_chats_name_what_is_wrong(client, messages, message):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ensemble", messages=messages)
    assert message in err.value.body["message"]


def test_chat_is_refused_for_a_checkpoint_without_a_template(cpu_tiny_project):
    checkpoint = cpu_tiny_project / "build/checkpoints/tiny-llama"
    deployment = Deployment(("ensemble",), Preprocessor.load(checkpoint, Limits(256, 319, 320)), None)
    with pytest.raises(LookupError, match="this model has no chat template"):
        deployment.chat_prompt(CHAT, True)


def test_a_bos_the_template_writes_is_not_doubled_by_preprocessing(tiny_checkpoint, tmp_path):
    """Llama checkpoints add BOS in tokenizer.json's post-processor and write it in their chat template:
    transformers tokenizes the rendered chat without special tokens, so one BOS. Preprocessing adds special
    tokens, so the API drops the template's own leading BOS."""
    from transformers import AutoTokenizer

    from tests.test_tokenization import bos_template, with_post_processor

    checkpoint = with_post_processor(tiny_checkpoint, tmp_path / "bos", bos_template(), add_bos_token=True)
    deployment = Deployment(("ensemble",), Preprocessor.load(checkpoint, Limits(256, 319, 320)), ChatTemplate.load(checkpoint))
    sent = deployment.chat_prompt(CHAT, add_generation_prompt=True)
    ids = deployment.pre.prepare(sent.encode(), 8).input_ids.tolist()
    expected = chat_ids(AutoTokenizer.from_pretrained(checkpoint))
    bos = deployment.pre.tokenizer.token_to_id(BOS)
    assert ids == expected and ids[0] == bos and ids[1] != bos


def _raw_post(front: OpenAIFront, path: str, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn


@pytest.mark.parametrize("model, role", [("ensemble", "orchestrator-disaggregated"), ("aggregated", "orchestrator-aggregated")])
def test_a_client_leaving_mid_stream_cancels_the_generation_and_frees_its_kv(client, server, model, role):
    before = cancelled_total(server, role)
    with busy(server, model):
        chunks = client.chat.completions.create(model=model, messages=CHAT, max_tokens=250, stream=True,
                                                extra_body={"ignore_eos": True})
        got = [next(chunks) for _ in range(3)]
        chunks.close()
        assert got[0].choices[0].delta.role == "assistant"
        assert cancels_after(server, role, before) == before + 1
    assert wait_kv_zero(server) == NO_KV


def test_a_client_leaving_before_a_non_streamed_answer_cancels_it(front, server):
    role = "orchestrator-disaggregated"
    before = cancelled_total(server, role)
    with busy(server, "ensemble"):
        conn = _raw_post(front, "/v1/completions", {"model": "ensemble", "prompt": "Call me", "max_tokens": 300, "ignore_eos": True})
        time.sleep(0.5)
        conn.sock.close()
        conn.close()
        assert cancels_after(server, role, before) == before + 1
    assert wait_kv_zero(server) == NO_KV


def test_ready_and_live_report_the_engines(front):
    for path, expected in (("/ready", "ready"), ("/live", "live")):
        conn = http.client.HTTPConnection("127.0.0.1", front.port, timeout=10)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            body = json.loads(resp.read())
            assert resp.status == 200 and body[expected] is True, body
        finally:
            conn.close()
    engines = body_of_ready(front)["engines"]
    assert engines == {m: {"role": r, "instances": 1, "alive": 1}
                       for m, r in (("aggregated_engine", "aggregated"), ("decode", "decode"), ("prefill", "prefill"))}


def body_of_ready(front) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{front.port}/ready", timeout=10) as resp:
        return json.load(resp)


def test_the_api_process_logs_no_errors(front):
    assert isinstance(front.log_path, Path)
    log = front.log_path.read_text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.mark.parametrize("field", ["max_completion_tokens", "max_tokens"])
def test_a_chats_length_limit_is_refused_under_the_name_it_was_sent_by(client, field):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ensemble", messages=CHAT, **{field: 5000})
    assert err.value.body["message"] == f"{field}: 5000 is over the limit 319" and err.value.body["param"] == field
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="ensemble", messages=CHAT, extra_body={"min_tokens": 9}, **{field: 4})
    assert err.value.body["message"] == f"min_tokens: 9 is over {field}=4" and err.value.body["param"] == "min_tokens"
