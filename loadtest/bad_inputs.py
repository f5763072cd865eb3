"""Bad requests, each with the error it must get: over HTTP `generate` and `generate_stream`, over gRPC to
the ensemble, and straight to the engine models. Used by the tests (each one answered with a clear error,
nothing else disturbed, no KV left) and by the soak (mixed into the load).

`expect` is a piece of the error text. Where preprocessing, the orchestrator or an engine answers, it names
the field and the limit. Where Triton's own HTTP JSON parser refuses a value of the wrong JSON type before
any model sees it, Triton 2.51's message names only the type ("attempt to access JSON non-signed-integer
as signed-integer"); over gRPC the same mistake is named ("inference input 'max_tokens' data-type is 'FP32',
but model 'ensemble' expects 'INT32'").
"""
from __future__ import annotations

import http.client
import json
import queue
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient

from disagg.triton.credential import PARAMETER
from tools.stream_client import end_stream

LIMITS = {"max_input_len": 256, "max_output_len": 319}  # configs/cpu-tiny.yaml


@dataclass(frozen=True)
class BadRequest:
    name: str
    via: str  # "generate" | "generate_stream" (HTTP body), "grpc" (ensemble), "engine" (an engine model, gRPC)
    expect: str
    body: dict | bytes | None = None  # HTTP
    inputs: tuple = ()  # gRPC: (name, value, triton type); value is one element or a list (shape [1, n])
    model: str = "ensemble"
    parameters: dict = field(default_factory=dict)  # engine: request parameters (the credential is added
    credential: bool = True  # unless this is False)


def _hi(**extra) -> dict:
    return {"text_input": "hi", "max_tokens": 8, **extra}


def _g(*extra, prompt: bytes = b"hi", max_tokens: int = 8) -> tuple:
    return (("text_input", prompt, "BYTES"), ("max_tokens", max_tokens, "INT32"), *extra)


def _engine(*extra) -> tuple:
    return (("input_ids", [0, 41, 273, 77], "INT32"), ("input_lengths", 4, "INT32"), ("request_output_len", 8, "INT32"), *extra)


CATALOG: list[BadRequest] = [
    BadRequest("malformed JSON", "generate", "failed to parse the request JSON buffer", b'{"text_input": "hi", '),
    BadRequest("prompt of the wrong JSON type", "generate", "attempt to access JSON non-string as string", {"text_input": 5, "max_tokens": 8}),
    BadRequest("max_tokens of the wrong JSON type", "generate", "non-signed-integer as signed-integer", _hi(max_tokens="eight")),
    BadRequest("two prompts in one request", "generate", "input 'text_input' batch size does not match", {"text_input": ["a", "b"], "max_tokens": 8}),
    BadRequest("no prompt", "generate", "missing required input(s) ['text_input']", {"max_tokens": 8}),
    BadRequest("empty prompt", "generate", "text_input: empty prompt", _hi(text_input="")),
    BadRequest("prompt over max_input_len", "generate", "over the limit max_input_len=256", _hi(text_input="word " * 400)),
    BadRequest("1 MB prompt", "generate", "over the limit max_input_len=256", _hi(text_input="word " * 200_000)),
    BadRequest("max_tokens 0", "generate", "max_tokens: 0 must be >= 1", _hi(max_tokens=0)),
    BadRequest("max_tokens negative", "generate", "max_tokens: -3 must be >= 1", _hi(max_tokens=-3)),
    BadRequest("max_tokens over the limit", "generate", "max_tokens: 5000 is over the limit 319", _hi(max_tokens=5000)),
    BadRequest("prompt + max_tokens over max_seq_len", "generate", "is over max_seq_len=320",
               _hi(text_input="word " * 100, max_tokens=300)),
    BadRequest("negative temperature", "generate", "temperature: -1.0 must be in [0, 100]", _hi(temperature=-1)),
    BadRequest("infinite temperature", "generate", "temperature: inf must be in [0, 100]", _hi(temperature=1e39)),
    BadRequest("top_p above 1", "generate", "runtime_top_p: 7.0 must be in [0, 1]", _hi(top_p=7.0)),
    BadRequest("negative top_k", "generate", "runtime_top_k: -1 must be in [0, vocab_size=512]", _hi(top_k=-1)),
    BadRequest("top_k over the vocabulary", "generate", "runtime_top_k: 100000 must be in [0, vocab_size=512]", _hi(top_k=100000)),
    BadRequest("stop_words of the wrong type", "generate", "attempt to access JSON non-string as string", _hi(stop_words=5)),
    BadRequest("stop_words given", "generate", "stop_words: not supported by this deployment", _hi(stop_words=["x"])),
    BadRequest("negative seed", "generate", "non-unsigned-integer as unsigned-integer", _hi(seed=-1)),
    BadRequest("seed and random_seed differ", "generate", "random_seed: 2 differs from seed=1", _hi(seed=1, random_seed=2)),
    BadRequest("min_tokens over max_tokens", "generate", "min_tokens: 9 is over max_tokens=8", _hi(min_tokens=9)),
    BadRequest("end_id outside the vocabulary", "generate", "end_id: 600 is outside the vocabulary (0..511)", _hi(end_id=600)),
    BadRequest("beam search", "generate", "beam_width: 4 is not supported", _hi(beam_width=4)),
    BadRequest("repetition penalty", "generate", "repetition_penalty: 1.3 is not supported", _hi(repetition_penalty=1.3)),
    BadRequest("log probs asked for", "generate", "return_log_probs: true is not supported", _hi(return_log_probs=True)),
    BadRequest("a LoRA task asked for", "generate", "lora_task_id: not supported by this deployment (LoRA needs", _hi(lora_task_id=5)),
    BadRequest("guided decoding asked for", "generate", "guided_decoding_guide_type: not supported by this deployment",
               _hi(guided_decoding_guide_type="json", guided_decoding_guide="{}")),
    BadRequest("exclude_input_in_output of the wrong JSON type", "generate", "non-boolean as boolean", _hi(exclude_input_in_output="yes")),
    BadRequest("unknown model", "generate", "Request for unknown model: 'nosuch' is not found", _hi(), model="nosuch"),
    BadRequest("streamed, max_tokens 0", "generate_stream", "max_tokens: 0 must be >= 1", _hi(max_tokens=0, stream=True)),
    BadRequest("streamed, prompt over max_input_len", "generate_stream", "over the limit max_input_len=256",
               _hi(text_input="word " * 400, stream=True)),
    BadRequest("streamed, NaN temperature", "generate_stream", "temperature: nan must be in [0, 100]", b'{"text_input": "hi", "max_tokens": 8, "temperature": NaN, "stream": true}'),
    BadRequest("non-UTF-8 prompt", "grpc", "text_input: not valid UTF-8 (byte 0xff at offset 2)", inputs=_g(prompt=b"hi\xff")),
    BadRequest("max_tokens of the wrong dtype", "grpc", "inference input 'max_tokens' data-type is 'FP32', but model 'ensemble' expects 'INT32'",
               inputs=(("text_input", b"hi", "BYTES"), ("max_tokens", 8.0, "FP32"))),
    BadRequest("NaN temperature", "grpc", "temperature: nan must be in [0, 100]", inputs=_g(("temperature", float("nan"), "FP32"))),
    BadRequest("10 MB prompt over gRPC", "grpc", "over the limit max_input_len=256", inputs=_g(prompt=b"word " * 2_000_000)),
    BadRequest("unknown request_type", "engine", "request_type: 'context_then_maybe' is not one of", inputs=_engine(),
               model="prefill", parameters={"request_type": "context_then_maybe"}),
    BadRequest("forged context_phase_params", "engine", "context_phase_params", inputs=_engine(("context_phase_params", list(b"DCPP\x01\x00{not json"), "UINT8")),
               model="decode", parameters={"request_type": "generation_only"}),
    BadRequest("generation_only without context_phase_params", "engine", "context_phase_params: required for a generation_only request",
               inputs=_engine(), model="decode", parameters={"request_type": "generation_only"}),
    BadRequest("engine call without the credential", "engine", "engine models serve this deployment's orchestrators only",
               inputs=_engine(), model="prefill", parameters={"request_type": "context_only"}, credential=False),
]


def _http(host: str, port: int, bad: BadRequest) -> tuple[int, str]:
    path = f"/v2/models/{bad.model}/{bad.via}"
    body = bad.body if isinstance(bad.body, bytes) else json.dumps(bad.body).encode()
    conn = http.client.HTTPConnection(host, port, timeout=120)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    finally:
        conn.close()


def infer_input(name: str, value, triton_type: str) -> grpcclient.InferInput:
    """One gRPC input of a request: `value` one element, or a list (shape [1, n], empty: [1, 0])."""
    dtype = {"BYTES": object, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "UINT8": np.uint8, "BOOL": bool}[triton_type]
    array = np.array([value if isinstance(value, list) else [value]], dtype=dtype)
    tensor = grpcclient.InferInput(name, list(array.shape), triton_type)
    tensor.set_data_from_numpy(array)
    return tensor


def _grpc(url: str, bad: BadRequest, internal_key: str) -> str | None:
    """The error the server answered with, or None if it answered without one."""
    parameters = dict(bad.parameters)
    if bad.via == "engine" and bad.credential:
        parameters[PARAMETER] = internal_key
    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    refused = False
    try:
        client.start_stream(callback=lambda result, error: got.put(error))
        client.async_stream_infer(bad.model, [infer_input(*i) for i in bad.inputs], parameters=parameters or None,
                                  enable_empty_final_response=True)
        error = got.get(timeout=120)
        refused = error is not None
        return None if error is None else error.message()
    finally:
        end_stream(client, refused)  # a request accepted, or not answered, is cancelled


def send(bad: BadRequest, http_url: str, grpc_url: str, internal_key: str, engine_urls: dict[str, str] | None = None) -> str:
    """Sends `bad` (an engine call to `engine_urls[model]` when its engine runs in a server of its own);
    returns the error text. AssertionError if it was not refused with `bad.expect`."""
    if bad.via in ("generate", "generate_stream"):
        host, port = http_url.rsplit(":", 1)
        status, text = _http(host, int(port), bad)
        assert status >= 400 or '"error"' in text, f"{bad.name}: accepted ({status}): {text[:200]}"
    else:
        url = (engine_urls or {}).get(bad.model, grpc_url) if bad.via == "engine" else grpc_url
        text = _grpc(url, bad, internal_key)
        assert text is not None, f"{bad.name}: accepted"
    assert bad.expect in text, f"{bad.name}: expected {bad.expect!r} in the error, got {text[:300]!r}"
    return text
