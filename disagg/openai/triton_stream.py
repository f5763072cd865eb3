"""One generation as one gRPC stream to a served ensemble, read asynchronously.

The ensemble is asked to stream whatever the API client asked for, so a client that goes away mid-answer
cancels the call: Triton cancels the ensemble request and the orchestrator stops the engines, freeing
their KV. The request side of the stream stays open until the final response, as Triton's gRPC stream
ends when both sides are done.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpcaio
from tritonclient.grpc import InferInput
from tritonclient.utils import np_to_triton_dtype


@dataclass(frozen=True)
class Chunk:
    text: str
    tokens: int  # tokens this text was decoded from (the ensemble's num_output_tokens)


class EngineError(RuntimeError):
    """The ensemble answered with an error."""


def _tensor(name: str, value, dtype) -> InferInput:
    array = np.array([[value]], dtype=dtype)
    tensor = InferInput(name, list(array.shape), "BYTES" if dtype is object else np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


_DTYPES = {
    "max_tokens": np.int32, "end_id": np.int32, "min_tokens": np.int32, "top_k": np.int32, "seed": np.uint64,
    "temperature": np.float32, "top_p": np.float32, "presence_penalty": np.float32, "frequency_penalty": np.float32,
    "service_class": object,
}


def ensemble_inputs(text: str, options: dict) -> list[InferInput]:
    """text_input plus each option (names of `_DTYPES`, None: not sent); always a stream of new text only."""
    inputs = [_tensor("text_input", text.encode(), object), _tensor("stream", True, np.bool_),
              _tensor("exclude_input_in_output", True, np.bool_)]
    unknown = set(options) - set(_DTYPES)
    if unknown:
        raise TypeError(f"unknown ensemble option(s): {', '.join(sorted(unknown))}")
    return inputs + [_tensor(name, value, _DTYPES[name]) for name, value in options.items() if value is not None]


def _is_final(result) -> bool:
    param = result.get_response().parameters.get("triton_final_response")
    return param is not None and param.bool_param


class TritonStreams:
    """A gRPC channel to the server, shared by every generation (HTTP/2 carries each as its own stream)."""

    def __init__(self, url: str):
        self.client = grpcaio.InferenceServerClient(url)

    async def generate(self, model: str, text: str, options: dict, request_id: str = "") -> AsyncIterator[Chunk]:
        done = asyncio.Event()

        async def requests():
            yield {"model_name": model, "inputs": ensemble_inputs(text, options), "request_id": request_id}
            await done.wait()

        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    finished = True  # an error response is the request's last
                    raise EngineError(error.message())
                tokens = result.as_numpy("num_output_tokens")
                yield Chunk(result.as_numpy("text_output").reshape(-1)[0].decode(), int(tokens.sum()) if tokens is not None else 0)
                if _is_final(result):
                    finished = True
                    break
            if not finished:
                raise EngineError(f"{model}: the stream ended before the final response")
        finally:
            done.set()  # ends the request side; the server then closes the stream
            if not finished:
                responses.cancel()  # the client went away (or stopped reading): Triton cancels the request

    async def ready(self) -> bool:
        try:
            return await self.client.is_server_ready()
        except Exception:  # noqa: BLE001 - unreachable counts as not ready
            return False

    async def live(self) -> bool:
        try:
            return await self.client.is_server_live()
        except Exception:  # noqa: BLE001 - unreachable counts as not live
            return False

    async def close(self) -> None:
        await self.client.close()
