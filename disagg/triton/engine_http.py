"""Engine hops over Triton's HTTP `generate_stream`, every response of every request read by one thread.

Over the gRPC stream (disagg.triton.engine_stream) each token an engine streams costs the orchestrator's
process Python's gRPC machinery (its reader, its polling thread, its C threads). Triton streams a decoupled
model's responses over HTTP too, one server-sent event per response (server src/http_server.cc,
`GenerateRequestClass`); read by one selector thread, they cost tensorrt_llm_bls's stub 0.13-0.17 ms of CPU
per token at 256 streams against 0.23-0.24 over gRPC (docs/measurements.md).

How Triton 2.51 maps a generate request (http_server.cc `HandleGenerate`, `ExactMappingInput`,
`ExactMappingOutput`): a JSON key named like a model input becomes that input, a list filling its shape's
dynamic dimensions (`[1, n]` for a batching model's `[-1, -1]`), a scalar one element; `id` is the request
id (`ParseJsonTritonRequestID`); any other key becomes a request parameter. Each output comes back as a
list, or a bare value when it has one element. A request the server refuses before the model sees it (an
unknown model, a bad input) is answered with an HTTP error and `{"error": ...}`; an error response of the
model's is an event `{"error": ...}`; the response flagged final ends the chunked body.

Each request has a connection of its own (an event stream is one HTTP response), opened for it and closed
with its answer (`Connection: close`). So a `stop` naming the id of a request in flight needs nothing else, a
server that is being reloaded refuses one request without touching another's, and nothing is cancelled. None
is kept open for the next request: Triton's shutdown first waits for every HTTP connection to close, before it
unloads any model, so an orchestrator's idle connection to its own server held that server's stop for its
whole exit timeout (the orchestrator's `finalize`, which would close it, comes only with the unloading).
"""
from __future__ import annotations

import json
import selectors
import socket
import threading
import traceback
from dataclasses import dataclass, field

import numpy as np

from disagg.triton.engine_request import EngineGone, EngineRequest, OnResponse

CONNECT_TIMEOUT_S = 5.0
READ_SIZE = 65536
# The dtypes of the outputs the orchestrator reads (disagg.triton.contract.OUTPUTS_READ): JSON carries none.
OUTPUT_DTYPES = {"output_ids": np.int32, "context_phase_params": np.uint8}


class JsonResult:
    """One response's outputs, read as tritonclient's InferResult reads them (`as_numpy`, None when absent)."""

    def __init__(self, outputs: dict):
        self.outputs = outputs

    def as_numpy(self, name: str) -> np.ndarray | None:
        value = self.outputs.get(name)
        return None if value is None else np.asarray(value, dtype=OUTPUT_DTYPES.get(name))


EMPTY = JsonResult({})


def body(request: EngineRequest) -> bytes:
    """The generate request's JSON: inputs flattened (the server gives them the model's shape), the id, and
    the parameters."""
    doc: dict = {name: array.reshape(-1).tolist() for name, array in request.inputs.items()}
    doc.update(request.parameters)
    doc["id"] = request.id
    return json.dumps(doc, separators=(",", ":")).encode()


@dataclass
class _Exchange:
    """One connection, and the request it carries while it carries one."""
    sock: socket.socket
    on_response: OnResponse | None = None
    status: int = 0
    chunked: bool = False
    length: int = -1  # of a body that is not chunked
    raw: bytearray = field(default_factory=bytearray)  # bytes received, not parsed yet
    events: bytearray = field(default_factory=bytearray)  # the body, not yet cut into events
    headers_done: bool = False


class HttpEngineServer:
    """One engine server: the connections carrying requests, and their reader."""

    def __init__(self, url: str):
        self.url = url
        host, _, port = url.removeprefix("http://").rpartition(":")
        self.address = (host.strip("[]"), int(port))
        self.host_header = f"{host}:{port}".encode()
        self._busy: dict[socket.socket, _Exchange] = {}
        self._by_handler: dict[OnResponse, _Exchange] = {}
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"engine-http {url}", daemon=True)
        self._reader.start()

    # The gRPC transport's surface (disagg.triton.engine_stream.EngineServer): here every request travels
    # alone, so the server is its own stream, for every model and for a `stop`.
    def shared(self, model: str) -> HttpEngineServer:
        return self

    def open(self) -> _Alone:
        return _Alone(self)

    def send(self, request: EngineRequest, on_response: OnResponse) -> None:
        head = (b"POST /v2/models/%s/generate_stream HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n") % (
                    request.model.encode(), self.host_header, len(payload := body(request)))
        exchange = _Exchange(self._connect(), on_response)
        with self._lock:
            if self._closed:
                exchange.sock.close()
                raise ConnectionError(f"the connection to the engine server {self.url} is closed")
            self._busy[exchange.sock] = exchange
            self._by_handler[on_response] = exchange
        try:
            exchange.sock.sendall(head + payload)
        except OSError as exc:
            self._drop(exchange)
            raise ConnectionError(f"the engine server {self.url} went away: {exc}") from None
        self._selector.register(exchange.sock, selectors.EVENT_READ)  # epoll: the reader's wait sees it at once

    def forget(self, request_id: str, on_response: OnResponse) -> None:
        """Later responses to the request that `on_response` handles are ignored; its connection is closed
        once its answer has ended."""
        with self._lock:
            exchange = self._by_handler.pop(on_response, None)
            if exchange is not None:
                exchange.on_response = None

    def in_flight(self) -> int:
        with self._lock:
            return len(self._by_handler)

    def connections(self) -> int:
        """Connections open now: one per request whose answer has not ended."""
        with self._lock:
            return len(self._busy)

    def close(self) -> None:
        """Closes every connection: requests still running get an error."""
        with self._lock:
            self._closed = True
            socks = list(self._busy)
        self._wake_w.send(b"\0")
        self._reader.join(timeout=2.0)
        for sock in socks:
            sock.close()
        self._wake_r.close()
        self._wake_w.close()
        self._selector.close()

    def retire(self) -> None:
        """Nothing to let go of: a replica that left its pool can stop once the answers in flight end, each
        closing its connection."""

    def _connect(self) -> socket.socket:
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise ConnectionError(f"the engine server {self.url} went away: {exc}") from None
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _drop(self, exchange: _Exchange) -> None:
        with self._lock:
            self._busy.pop(exchange.sock, None)
            if exchange.on_response is not None and self._by_handler.get(exchange.on_response) is exchange:
                del self._by_handler[exchange.on_response]
        try:
            self._selector.unregister(exchange.sock)
        except (KeyError, ValueError):
            pass
        exchange.sock.close()

    def _read(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    break
            for key, _ in self._selector.select(timeout=1.0):
                if key.fileobj is self._wake_r:
                    self._wake_r.recv(4096)
                    continue
                with self._lock:
                    exchange = self._busy.get(key.fileobj)
                if exchange is not None:
                    self._receive(exchange)
        with self._lock:
            orphans = list(self._busy.values())
            self._busy, self._by_handler = {}, {}
        for exchange in orphans:
            self._deliver(exchange, None, EngineGone(f"the connection to the engine server {self.url} was closed"), True)

    def _receive(self, exchange: _Exchange) -> None:
        try:
            data = exchange.sock.recv(READ_SIZE)
        except OSError as exc:
            data, reason = b"", str(exc)
        else:
            reason = "it closed the connection"
        if not data:
            self._drop(exchange)
            self._deliver(exchange, None, EngineGone(f"the engine server {self.url} went away: {reason}"), True)
            return
        exchange.raw += data
        try:
            ended = self._parse(exchange)
        except ValueError as exc:
            self._drop(exchange)
            self._deliver(exchange, None, f"unreadable answer from the engine server {self.url}: {exc}", True)
            return
        if ended:
            self._drop(exchange)

    def _parse(self, exchange: _Exchange) -> bool:
        """Consumes what `raw` holds; True once the answer has ended."""
        if not exchange.headers_done:
            end = exchange.raw.find(b"\r\n\r\n")
            if end < 0:
                return False
            lines = bytes(exchange.raw[:end]).decode("latin-1").split("\r\n")
            del exchange.raw[:end + 4]
            exchange.status = int(lines[0].split(" ", 2)[1])
            headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
            exchange.chunked = headers.get("transfer-encoding", "").lower() == "chunked"
            exchange.length = int(headers.get("content-length", "0")) if not exchange.chunked else -1
            exchange.headers_done = True
        if not exchange.chunked:
            if len(exchange.raw) < exchange.length:
                return False
            text = bytes(exchange.raw[:exchange.length])
            self._deliver(exchange, None, _error(text, exchange.status), True)
            return True
        while True:
            line_end = exchange.raw.find(b"\r\n")
            if line_end < 0:
                return False
            size = int(bytes(exchange.raw[:line_end]).split(b";")[0], 16)
            if len(exchange.raw) < line_end + 2 + size + 2:
                return False
            exchange.events += exchange.raw[line_end + 2:line_end + 2 + size]
            del exchange.raw[:line_end + 2 + size + 2]
            self._events(exchange)
            if size == 0:
                if exchange.on_response is not None:  # no error event ended it
                    self._deliver(exchange, EMPTY, None, True)
                return True

    def _events(self, exchange: _Exchange) -> None:
        while (end := exchange.events.find(b"\n\n")) >= 0:
            event = bytes(exchange.events[:end])
            del exchange.events[:end + 2]
            if not event.startswith(b"data: "):
                continue
            doc = json.loads(event[6:])
            if "error" in doc:
                self._deliver(exchange, None, doc["error"], True)
            else:
                self._deliver(exchange, JsonResult(doc), None, False)

    def _deliver(self, exchange: _Exchange, result: JsonResult | None, error: str | None, final: bool) -> None:
        on_response = exchange.on_response
        if on_response is None:
            return
        if final:
            exchange.on_response = None
            with self._lock:
                if self._by_handler.get(on_response) is exchange:
                    del self._by_handler[on_response]
        try:
            on_response(result, error, final)
        except Exception:  # noqa: BLE001 - a fault of one request's handler must not end the reader
            exchange.on_response = None
            traceback.print_exc()  # a stub's stderr goes to the server's log


class _Alone:
    """What a `stop` travels on: the server itself, whose requests each travel alone; closing it closes nothing."""

    def __init__(self, server: HttpEngineServer):
        self.send, self.forget = server.send, server.forget

    def close(self) -> None:
        pass


def _error(text: bytes, status: int) -> str:
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {text[:200].decode('utf-8', 'replace')}"
