"""`tensorrt_llm_bls` (orchestrator.bls): the ensemble's text contract in one Python model. Its config
declares the ensemble's inputs and outputs and those only upstream's tensorrt_llm_bls has, and on a real tritonserver it answers every request as
`ensemble` does: the same text per response, token counts and input errors, and a cancellation stops the
engines and frees their KV."""
from __future__ import annotations

import contextlib
import dataclasses
import queue
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import model_config_pb2

from disagg.openai.deployment import Deployment
from disagg.render import plan_models, render_repository
from disagg.repository import parse_config
from disagg.spec import load_spec
from loadtest.bad_inputs import BadRequest, infer_input, send
from tests.e2e_helpers import busy, cancelled_total, cancels_after, never_token, wait_kv_zero
from tools.stream_client import StreamError, build_inputs, stream

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("preprocessing", "postprocessing", "prefill", "decode", "disagg_orchestrator", "ensemble", "tensorrt_llm_bls")
# What upstream's tensorrt_llm_bls (all_models/inflight_batcher_llm/tensorrt_llm_bls/config.pbtxt, v0.17.0 to
# c2e65b8) declares beyond the ensemble's inputs.
UPSTREAM_BLS_ONLY_INPUTS = {
    "image_input": "FP16", "image_bytes_input": "UINT8", "image_url_input": "STRING", "video_bytes_input": "UINT8",
    "num_draft_tokens": "INT32", "use_draft_logits": "BOOL",
}
PROMPTS = ["It was the best of times", "Unicode: café naïve 東京 ✓", "a", "def forward(self, x):\n    return x"]


def _with_bls(spec):
    return dataclasses.replace(spec, orchestrator=dataclasses.replace(spec.orchestrator, bls=True))


def test_the_bls_declares_the_ensembles_inputs_and_outputs_and_is_rendered_only_when_asked():
    spec = load_spec(ROOT / "configs/cpu-tiny.yaml")
    assert "tensorrt_llm_bls" not in [m.name for m in plan_models(spec)]
    models = {m.name: parse_config(m.name, m.config) for m in plan_models(_with_bls(spec))}
    bls, ensemble = models["tensorrt_llm_bls"], models["ensemble"]
    assert bls.backend == "python" and bls.model_transaction_policy.decoupled
    bls_only = [t for t in bls.input if t.name not in {e.name for e in ensemble.input}]
    assert [t for t in bls.input if t not in bls_only] == list(ensemble.input) and list(bls.output) == list(ensemble.output)
    assert {t.name: model_config_pb2.DataType.Name(t.data_type).removeprefix("TYPE_") for t in bls_only} == UPSTREAM_BLS_ONLY_INPUTS
    assert all(t.optional for t in bls_only)
    params = {k: v.string_value for k, v in bls.parameters.items()}
    pre = {k: v.string_value for k, v in models["preprocessing"].parameters.items()}
    assert params["mode"] == "disaggregated" and params["context_model_name"] == "prefill"
    assert {k: params[k] for k in pre} == pre  # the same limits and tokenizer as preprocessing
    assert params["skip_special_tokens"] == "true"


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    """cpu-tiny's built engines behind a repository rendered with orchestrator.bls, beside the project's own."""
    with contextlib.chdir(cpu_tiny_project):
        spec = dataclasses.replace(_with_bls(load_spec(Path("configs/cpu-tiny.yaml"))), model_repository=Path("bls_repository"))
        render_repository(spec, spec.model_repository)
    s = start_triton(cpu_tiny_project / "bls_repository", "--model-control-mode=explicit", *(f"--load-model={m}" for m in MODELS))
    yield s
    s.stop()


def _responses(url: str, model: str, inputs) -> list[tuple[str, int]]:
    """(text_output, num_output_tokens) of each response that carried output, until the final one."""
    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    out = []
    try:
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error.message()
            text = result.as_numpy("text_output")
            if text is not None:
                out.append((text.reshape(-1)[0].decode(), int(result.as_numpy("num_output_tokens").reshape(-1)[0])))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.e2e
def test_the_bls_answers_each_request_exactly_as_the_ensemble(server):
    cases = [dict(stream=s) for s in (True, False)] + [
        dict(stream=False, exclude_input_in_output=False),  # the prompt's tokens first, counted too
        dict(stream=True, temperature=0.8, top_k=50, top_p=0.9, seed=4242),
        dict(stream=True, min_length=12, end_id=2),  # the older name of min_tokens
    ]
    for prompt in PROMPTS:
        for case in cases:
            case = dict(case)
            streaming = case.pop("stream")
            expected = _responses(server.grpc_url, "ensemble", build_inputs(prompt, 24, streaming, **case))
            got = _responses(server.grpc_url, "tensorrt_llm_bls", build_inputs(prompt, 24, streaming, **case))
            assert got == expected, (prompt, streaming, case)
            assert sum(n for _, n in got) >= (24 if case.get("min_length") else 1)
    assert len(expected) > 2  # streamed: a response per token


@pytest.mark.e2e
@pytest.mark.parametrize("prompt, max_tokens, options, message", [
    ("", 8, {}, "text_input: empty prompt"),
    (b"hi\xff", 8, {}, "text_input: not valid UTF-8 (byte 0xff at offset 2)"),
    ("word " * 400, 8, {}, "text_input: prompt is 802 tokens, over the limit max_input_len=256"),
    ("hi", 5000, {}, "max_tokens: 5000 is over the limit"),
    ("hi", 8, {"min_tokens": 9}, "min_tokens: 9 is over max_tokens=8"),
    ("hi", 8, {"min_tokens": 2, "min_length": 3}, "min_length: 3 differs from min_tokens=2"),
    ("hi", 8, {"top_p": 7.0}, "runtime_top_p: 7.0 must be in [0, 1]"),
])
def test_the_bls_refuses_bad_inputs_as_the_ensemble_does_and_keeps_serving(server, prompt, max_tokens, options, message):
    for model in ("ensemble", "tensorrt_llm_bls"):
        with pytest.raises(StreamError) as refused:
            stream(server.grpc_url, model, prompt, max_tokens, **options)
        assert message in str(refused.value), (model, str(refused.value))
    assert stream(server.grpc_url, "tensorrt_llm_bls", PROMPTS[0], 8).text == stream(server.grpc_url, "ensemble", PROMPTS[0], 8).text
    assert not any(wait_kv_zero(server).values())


HI = (("text_input", b"hi", "BYTES"), ("max_tokens", 8, "INT32"))


@pytest.mark.e2e
def test_upstreams_inputs_for_what_the_engines_cannot_do_are_refused_by_name_and_accepted_empty(server):
    lora = ("lora_task_id", 0, "UINT64")  # an id: even task 0 asks for a LoRA
    for model in ("ensemble", "tensorrt_llm_bls"):
        got = send(BadRequest("a LoRA task", "grpc", "lora_task_id: not supported by this deployment", inputs=(*HI, lora), model=model),
                   server.http_url, server.grpc_url, server.internal_key)
        assert got.endswith("lora_task_id: not supported by this deployment (LoRA needs engines built with the LoRA plugin and a "
                            "LoRA cache, and these are not; send none)"), got  # the ensemble's begins "in ensemble ..."
    draft = BadRequest("a draft model", "grpc", "num_draft_tokens: not supported by this deployment (speculative decoding needs a draft model",
                       inputs=(*HI, ("num_draft_tokens", 3, "INT32")), model="tensorrt_llm_bls")  # upstream's BLS alone declares it
    send(draft, server.http_url, server.grpc_url, server.internal_key)
    nothing = [infer_input("embedding_bias_words", [b""], "BYTES"), infer_input("embedding_bias_weights", [], "FP32"),
               infer_input("image_url_input", b"", "BYTES")]
    plain = _responses(server.grpc_url, "ensemble", build_inputs(PROMPTS[0], 8))
    for model, extra in (("ensemble", nothing[:2]), ("tensorrt_llm_bls", nothing)):
        assert _responses(server.grpc_url, model, [*build_inputs(PROMPTS[0], 8), *extra]) == plain
    assert not any(wait_kv_zero(server).values())


def test_the_openai_api_serves_the_bls_as_a_model(server, cpu_tiny_project):
    assert Deployment.load(cpu_tiny_project / "bls_repository").models == ("ensemble", "aggregated", "tensorrt_llm_bls")


@pytest.mark.e2e
def test_a_cancelled_bls_stream_stops_the_engines_and_frees_their_kv(server, cpu_tiny_project):
    """Called directly, the BLS hears of the cancellation from its own response sender."""
    before = cancelled_total(server, "orchestrator-disaggregated")
    with busy(server, "tensorrt_llm_bls"):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        got: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        inputs = build_inputs("Call me", 300, end_id=never_token(cpu_tiny_project))
        client.async_stream_infer("tensorrt_llm_bls", inputs, enable_empty_final_response=True)
        for _ in range(3):
            result, error = got.get(timeout=30)
            assert error is None and not result.get_response().parameters["triton_final_response"].bool_param
        client.stop_stream(cancel_requests=True)
        client.close()
        assert cancels_after(server, "orchestrator-disaggregated", before) == before + 1
    assert not any(wait_kv_zero(server).values())
