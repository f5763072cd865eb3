"""Streams one prompt through a Triton ensemble over gRPC, printing text as it arrives, then latency.

    .venv/bin/python tools/stream_client.py --prompt "The quick brown fox" --max-tokens 64
    .venv/bin/python tools/stream_client.py --model aggregated --temperature 0.8 --top-k 20 --seed 7

Definitions (measured here, at the client):
    TTFT      request sent -> first response with non-empty text
    ITL       every gap between consecutive responses with non-empty text (an empty one, such as the
              final response or half a UTF-8 character, is no token arrival)
    tokens/s  text responses after the first / time from the first text to the last
              (the decode rate, counting one token per streamed response)
`stream()` is the importable core that tests and benchmarks reuse.
"""
from __future__ import annotations

import argparse
import queue
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# Optional ensemble inputs: name -> (Triton type, numpy type). The ensembles declare more (upstream's set,
# see templates/python/ensemble.pbtxt.j2); these are the scalars a client here may send.
SAMPLING_INPUTS = {
    "temperature": ("FP32", np.float32),
    "top_k": ("INT32", np.int32),
    "top_p": ("FP32", np.float32),
    "seed": ("UINT64", np.uint64),
    "random_seed": ("UINT64", np.uint64),  # seed's name in upstream's ensemble up to v0.19.0
    "end_id": ("INT32", np.int32),
    "pad_id": ("INT32", np.int32),
    "min_tokens": ("INT32", np.int32),  # end_id cannot end the answer before this many tokens
    "min_length": ("INT32", np.int32),  # min_tokens' older name (genai-perf --output-tokens-mean-deterministic)
    "exclude_input_in_output": ("BOOL", bool),  # false: a non-streamed answer starts with the prompt
    "service_class": ("BYTES", object),  # one of the deployment's orchestrator.service_classes
}


class StreamError(RuntimeError):
    """The server answered the request with an error; the message is the server's."""


@dataclass(frozen=True)
class StreamResult:
    text: str
    chunks: tuple[str, ...]  # text of each response that carried output, in order (streamed: the last is
    # the final response, which holds only the rest of a character the generation left unfinished)
    timestamps: tuple[float, ...]  # seconds from send to each of those responses
    ttft: float | None  # None: no text came back
    itl: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float | None:
        decode_time = sum(self.itl)
        return len(self.itl) / decode_time if decode_time > 0 else None


def _input(name: str, value, triton_type: str, np_type) -> grpcclient.InferInput:
    data = np.array([[value]], dtype=np_type)  # [batch=1, 1]
    tensor = grpcclient.InferInput(name, list(data.shape), triton_type)
    tensor.set_data_from_numpy(data)
    return tensor


def build_inputs(prompt: str | bytes, max_tokens: int, stream: bool = True, **sampling) -> list[grpcclient.InferInput]:
    """The ensemble's inputs; `sampling` keys are those of SAMPLING_INPUTS (None values are left out)."""
    unknown = set(sampling) - set(SAMPLING_INPUTS)
    if unknown:
        raise TypeError(f"unknown sampling input(s): {', '.join(sorted(unknown))}")
    raw = prompt.encode() if isinstance(prompt, str) else prompt
    inputs = [
        _input("text_input", raw, "BYTES", object),
        _input("max_tokens", max_tokens, "INT32", np.int32),
        _input("stream", stream, "BOOL", bool),
    ]
    for name, value in sampling.items():
        if value is not None:
            inputs.append(_input(name, value, *SAMPLING_INPUTS[name]))
    return inputs


def end_stream(client: grpcclient.InferenceServerClient, request_ended: bool) -> None:
    """Closes a client's gRPC stream, cancelling its request only if it is still running: a client that gives
    up cancels, never waits on. One whose request has ended (a final response; an error is one) does not:
    after a refused request Triton 2.51 then keeps the ensemble loaded, and the next stop waits out its exit
    timeout (README, Known problems)."""
    client.stop_stream(cancel_requests=not request_ended)
    client.close()


def stream(
    url: str, model: str, prompt: str | bytes, max_tokens: int, *, streaming: bool = True,
    timeout_s: float = 120.0, on_text: Callable[[str], None] | None = None, **sampling,
) -> StreamResult:
    """Sends one request over a gRPC stream and collects every response until the final one.
    `streaming` is the ensemble's `stream` input (False: the whole text in one response); `sampling`
    holds optional inputs named as in SAMPLING_INPUTS. Raises StreamError with the server's message."""
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    finished = False
    try:
        client.start_stream(callback=lambda result, error: responses.put((time.perf_counter(), result, error)))
        sent = time.perf_counter()
        inputs = build_inputs(prompt, max_tokens, streaming, **sampling)
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        chunks, stamps = [], []
        while True:
            try:
                at, result, error = responses.get(timeout=max(0.0, sent + timeout_s - time.perf_counter()))
            except queue.Empty:
                raise TimeoutError(f"{model}: no final response after {timeout_s:.0f} s") from None
            if error is not None:  # an error is the request's last response
                finished = True
                raise StreamError(error.message() if isinstance(error, InferenceServerException) else str(error))
            out = result.as_numpy("text_output")
            if out is not None:
                text = out.reshape(-1)[0].decode()
                chunks.append(text)
                stamps.append(at - sent)
                if on_text is not None:
                    on_text(text)
            if result.get_response().parameters["triton_final_response"].bool_param:
                finished = True
                break
    finally:
        end_stream(client, finished)
    arrivals = [at for at, text in zip(stamps, chunks) if text]
    return StreamResult(
        text="".join(chunks), chunks=tuple(chunks), timestamps=tuple(stamps),
        ttft=arrivals[0] if arrivals else None, itl=tuple(b - a for a, b in zip(arrivals, arrivals[1:])),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="127.0.0.1:8001", help="Triton gRPC address")
    p.add_argument("--model", default="ensemble", help="ensemble (disaggregated) or aggregated (baseline)")
    p.add_argument("--prompt", default="The quick brown fox", help="prompt text")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens to generate")
    p.add_argument("--temperature", type=float, help="sampling temperature (server default: greedy)")
    p.add_argument("--top-k", type=int, help="sample from the k most likely tokens")
    p.add_argument("--top-p", type=float, help="nucleus sampling threshold")
    p.add_argument("--seed", type=int, help="sampling seed")
    p.add_argument("--min-tokens", type=int, help="no end_id before this many new tokens")
    p.add_argument("--service-class", help="the request's class of service (the deployment's orchestrator.service_classes)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the final response")
    a = p.parse_args(argv)
    try:
        r = stream(
            a.url, a.model, a.prompt, a.max_tokens, timeout_s=a.timeout,
            on_text=lambda t: print(t, end="", flush=True),
            temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, seed=a.seed, min_tokens=a.min_tokens,
            service_class=a.service_class,
        )
    except (StreamError, TimeoutError, InferenceServerException) as exc:
        print(f"\nerror: {exc}")
        return 1
    print()
    if r.ttft is None:
        print("no text came back")
        return 1
    print(f"TTFT {r.ttft * 1e3:.1f} ms (send -> first text), {len(r.chunks)} responses")
    if r.itl:
        p50, p95 = np.percentile(np.array(r.itl) * 1e3, [50, 95])
        print(f"ITL p50 {p50:.2f} ms, p95 {p95:.2f} ms (gaps between responses that carry text)")
        print(f"{r.tokens_per_s:.1f} tokens/s (decode rate, one token per response)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
