"""gRPC streams to an engine server, each carrying many requests, their responses dispatched by request id.

A tritonclient stream per call to an engine (a new HTTP/2 stream, a reader thread, a close) cost about
1.3 ms of every hop on this machine, twice on a request's way to its first decode token. Triton 2.51 puts
the request id in every response of a stream, errors included ("[request id: ...]" requests refused by
the server too), so one long-lived stream per engine model can carry every hop of an orchestrator
instance to it. A request id must be unique among the requests in flight on one stream: a `stop`, which
names the request it stops by that request's id, goes over a stream of its own (`EngineServer.open`).

One stream per model, not per server: Triton 2.51 answers a request it refuses before making a request object
(a model it does not have, or has not loaded yet) the way it answers a model that is not decoupled, and that
way starts its write without waiting for a decoupled response's write in flight on the same stream (server
src/grpc/infer_handler.h `WriteResponseIfReady`; src/grpc/stream_infer_handler.cc, step READ). Two writes at
once on one gRPC stream abort the server (`proto_buffer_writer.h:65] ASSERTION FAILED`: README, Known
problems). A model being reloaded refuses requests while the other models of its server stream tokens;
on a stream of its own, a refusal meets no other model's responses.

Every stream opens with a request for a model no server has (`OPENING`). Triton 2.51 reads a stream's first
request into the state that waits for the stream's end (server src/grpc/stream_infer_handler.cc, step START),
so that request, and through it its model, stays referenced until the stream closes. A stream whose first hop
went to prefill kept prefill loaded until the orchestrator closed the stream in its own `finalize`: every stop
of a deployment took a second longer, and prefill unloaded through the repository API (as the watchdog reloads
a model) kept its stubs running for as long as the stream stayed open (tests/test_engine_unload.py). A request
for an unknown model is refused before a request object is made, so the opening pins nothing. Its refusal is
written the way just described, so nothing else is sent on the stream until it has come back: a decoupled
response that found that write in flight would be queued, and the write's end does not send what it queued
(stream_infer_handler.cc, step WRITTEN): it would wait for the stream's next response.

There is no per-request cancellation on a shared stream (a gRPC cancel ends the whole stream): a request
cut short is ended with `stop`, which the orchestrator does anyway, since cancelled gRPC streams are what
crashed Triton 2.51 servers under load (README, Known problems).
"""
from __future__ import annotations

import queue
import threading
import traceback

import grpc
import numpy as np
from tritonclient.grpc import InferResult, service_pb2, service_pb2_grpc
from tritonclient.utils import np_to_triton_dtype, serialize_byte_tensor

from disagg.triton.engine_request import EngineGone, EngineRequest, OnResponse

# The message size bound tritonclient sets on its channels (Triton's MAX_GRPC_MESSAGE_SIZE).
MAX_MESSAGE = 2**31 - 1
# The stream's first request (see the module's docstring): refused by every server, answered with an error
# that no handler claims.
OPENING = service_pb2.ModelInferRequest(model_name="disagg-stream-opening", id="disagg-stream-opening")
OPENING_WAIT_S = 5.0  # how long a request waits for the opening's answer before the stream counts as broken


def _message(request: EngineRequest) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest as tritonclient's `async_stream_infer` builds it, with an empty final response asked for."""
    message = service_pb2.ModelInferRequest(model_name=request.model, id=request.id)
    for name, array in request.inputs.items():
        message.inputs.add(name=name, datatype=np_to_triton_dtype(array.dtype), shape=array.shape)
        raw = serialize_byte_tensor(array).tobytes() if array.dtype == np.object_ else np.ascontiguousarray(array).tobytes()
        message.raw_input_contents.append(raw)
    for name in request.outputs:
        message.outputs.add(name=name)
    for key, value in request.parameters.items():
        message.parameters[key].string_param = value
    message.parameters["triton_enable_empty_final_response"].bool_param = True
    return message


class EngineStream:
    """One bidirectional ModelStreamInfer call; `send` registers a request's handler, a reader thread calls
    it per response. When the stream breaks (the engine server went away), every request still on it gets
    the error, and the stream takes no more."""

    def __init__(self, channel: grpc.Channel, name: str):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(OPENING)
        self._handlers: dict[str, OnResponse] = {}
        self._lock = threading.Lock()
        self._opened = threading.Event()  # set once the opening's answer is back, or the stream broke
        self.broken: str | None = None
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        self._responses = stub.ModelStreamInfer(iter(self._requests.get, None))
        self._reader = threading.Thread(target=self._read, name=f"engine-stream {name}", daemon=True)
        self._reader.start()

    def send(self, request: EngineRequest, on_response: OnResponse) -> None:
        if not self._opened.wait(OPENING_WAIT_S):
            raise ConnectionError(f"the engine server did not answer the stream's opening within {OPENING_WAIT_S:g} s")
        with self._lock:
            if self.broken is not None:
                raise ConnectionError(self.broken)
            if request.id in self._handlers:
                raise ValueError(f"request id {request.id!r} is already in flight on this stream")
            self._handlers[request.id] = on_response
        self._requests.put(_message(request))

    def forget(self, request_id: str, on_response: OnResponse) -> None:
        """Drops the request's handler, if it is still `on_response` (a request sent again under the same id
        has its own): later responses, if any come, are ignored."""
        with self._lock:
            if self._handlers.get(request_id) == on_response:
                del self._handlers[request_id]

    def in_flight(self) -> int:
        with self._lock:
            return len(self._handlers)

    def close(self) -> None:
        """Half-closes the stream (the server ends it once its requests are answered)."""
        self._requests.put(None)

    def _read(self) -> None:
        try:
            for response in self._responses:
                self._dispatch(response)
            reason = "the engine server ended the stream"
        except grpc.RpcError as exc:
            reason = f"stream to the engine server broke: {exc.code().name}: {exc.details()}"
        with self._lock:
            self.broken = reason
            orphans, self._handlers = self._handlers, {}
        self._opened.set()  # a request waiting to be sent finds the stream broken
        for on_response in orphans.values():
            on_response(None, EngineGone(reason), True)

    def _dispatch(self, response: service_pb2.ModelStreamInferResponse) -> None:
        request_id = response.infer_response.id
        if request_id == OPENING.id:
            self._opened.set()
            return
        with self._lock:
            on_response = self._handlers.get(request_id)
        if on_response is None:
            return
        if response.error_message:
            final, result, error = True, None, response.error_message
        else:
            final = response.infer_response.parameters["triton_final_response"].bool_param
            result, error = InferResult(response.infer_response), None
        if final:
            self.forget(request_id, on_response)
        try:
            on_response(result, error, final)
        except Exception:  # noqa: BLE001 - a fault of one request's handler must not end the reader, and every request on the stream
            self.forget(request_id, on_response)  # its caller's own deadline ends that request
            traceback.print_exc()  # a stub's stderr goes to the server's log


def _channel(url: str) -> grpc.Channel:
    """A channel with connections of its own: by default gRPC shares them between channels to one address,
    and a new channel would take over the old one's connection in its reconnect back-off, refusing calls
    with the old "Connection refused" although the server is back."""
    return grpc.insecure_channel(url, options=[
        ("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.use_local_subchannel_pool", 1),
    ])


class EngineServer:
    """One engine server's channel and the shared stream to each of its models on it. After a stream broke,
    the channel and every stream are made anew: a channel whose server went away waits out a growing
    reconnect back-off (1 s, 1.6 s, 2.6 s ...) before it tries again, and refuses every call meanwhile, long
    after a restarted server is back."""

    def __init__(self, url: str):
        self.url = url
        self.channel = _channel(url)
        self._shared: dict[str, EngineStream] = {}
        self._lock = threading.Lock()

    def shared(self, model: str) -> EngineStream:
        """The stream that carries every request to `model` (see the module's docstring)."""
        with self._lock:
            self._renew_if_broken()
            if model not in self._shared:
                self._shared[model] = EngineStream(self.channel, f"{self.url} {model}")
            return self._shared[model]

    def open(self) -> EngineStream:
        """A stream for one request only (the caller closes it)."""
        with self._lock:
            self._renew_if_broken()
            return EngineStream(self.channel, self.url)

    def _renew_if_broken(self) -> None:
        if any(stream.broken is not None for stream in self._shared.values()):
            self.channel.close()
            self.channel, self._shared = _channel(self.url), {}

    def retire(self) -> None:
        """Half-closes the shared streams: the server ends each once it has answered what it holds, and a
        server that is stopping waits for its clients' streams to end. Nothing is cancelled (see the module's
        docstring); `close` the channel later."""
        with self._lock:
            for stream in self._shared.values():
                stream.close()

    def close(self) -> None:
        self.retire()
        self.channel.close()
