"""A hop: one call from the orchestrator to an engine model, and where it goes.

Engines are reached through the engine server's own endpoints rather than BLS: in Triton 2.51 concurrent
decoupled BLS streams corrupt the python backend's heap (seen as `malloc(): unaligned fastbin chunk
detected` and stub segfaults), while client calls are a well-trodden path.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.triton import cancel_board, credential, load_board
from disagg.triton.engine_request import EngineGone, EngineRequest
from disagg.triton.metrics import STUB_LOCK
from disagg.triton.transport import EngineStreams

CANCEL_CHECK_S = 0.05
# What Triton core answers for a model it has not loaded (model_repository_manager.cc): an engine server
# that has just been restarted, before its model is back.
MODEL_NOT_LOADED = "Request for unknown model"
_DONE = object()


class HopError(RuntimeError):
    """A hop that failed. `engine_away`: the engine is coming back (its instances died and are being
    reloaded, its pool has no replica yet, its tritonserver is being restarted), so a drain waits for it."""

    def __init__(self, message: str, engine_away: bool = False):
        super().__init__(message)
        self.engine_away = engine_away


@dataclass(frozen=True)
class Engine:
    """Where a hop goes: an engine model on one server (a pool's replica, or the one server of the model)."""

    model: str
    url: str
    pool: str = ""  # the pool's source (disagg.triton.replicas), for a replica

    @property
    def replica(self) -> bool:
        return bool(self.pool)

    @property
    def site(self) -> str:
        """What its speed is measured for (disagg.triton.sla): its pool, or its one server."""
        return self.pool or self.url

    @property
    def name(self) -> str:
        return f"{self.model}@{self.url}" if self.replica else self.model


class Cancelled(Exception):
    """The client cancelled the request (its cancel flag, or its response sender)."""


class Hop:
    """One call to an engine model. Its responses (or, with tokens handed on, only its end and errors) reach
    the caller through a queue, so the caller can time out and notice cancellation while the engine works.

    Over HTTP each call has a connection of its own (disagg.triton.engine_http); over gRPC it goes on the engine server's
    shared stream (disagg.triton.engine_stream), or on a stream of its own (`own_stream`) for a `stop`,
    which reuses the id of the request it stops.

    `pids`: the processes of the model's instances when the hop began (from the load board). If one of
    them dies, the hop fails at the next check, naming it, instead of waiting out its timeout: Triton
    never answers a request whose stub was killed.

    Tokens can be handed on from the stream's reader thread, without waiting for the request's worker to wake
    (0.16-0.19 ms at one stream, more when the workers queue for the GIL), and never once the caller has left
    the hop (`leave`), whose answer may then be out:
    - `on_first_token`: called once, with a list holding the hop's first token, before the caller gets every
      token (the context phase's token goes to the client while the worker reads the handoff's params);
    - `on_tokens`: called with each response's tokens, which the caller then never gets: it waits only for the
      end, an error or a timeout. At 256 streams a token's hand-over to its worker cost 10% of
      tensorrt_llm_bls's tokens/s (docs/measurements.md)."""

    def __init__(self, stream: EngineStreams, engine: Engine, inputs: dict[str, np.ndarray], request_id: str,
                 request_type: str, key: str, liveness: load_board.Liveness, pids: dict[int, str] | None = None,
                 own_stream: bool = False, on_first_token: Callable[[list[int]], None] | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None):
        if on_first_token is not None and on_tokens is not None:
            raise ValueError("a hop hands on its first token or every token, not both")
        self.model, self.request_id = engine.name, request_id
        self.liveness, self.pids = liveness, pids or {}
        self.results_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stream, self.own_stream = stream, own_stream
        self._hand, self._hand_all = on_tokens or on_first_token, on_tokens is not None
        self._hand_lock = threading.Lock()  # held while a handler runs, so `leave` waits it out
        self.last_response = time.monotonic()  # the hop's deadline counts from it, tokens handed on or not
        request = EngineRequest(engine.model, request_id, inputs, {"request_type": request_type, credential.PARAMETER: key})
        try:
            stream.send(request, self._on_response)
        except ConnectionError as exc:
            raise HopError(f"{engine.name}: {exc}", engine_away=True) from None

    def _on_response(self, result, error: str | None, final: bool) -> None:
        self.last_response = time.monotonic()
        if error is not None:  # the server went away (EngineGone), or it or its engine refused
            away = isinstance(error, EngineGone) or MODEL_NOT_LOADED in error
            self.results_queue.put(HopError(f"{self.model}: {error}", engine_away=away))
        else:
            ids = result.as_numpy("output_ids")
            tokens = [] if ids is None else ids.reshape(-1).tolist()
            # before the handoff's params are read: a few hundred bytes, not the client's
            if tokens and self._hand_on(tokens) and self._hand_all:
                ids, tokens = None, []
            params = result.as_numpy("context_phase_params")
            if ids is not None or params is not None:
                self.results_queue.put((tokens, params))
        if final:
            self.results_queue.put(_DONE)

    def _hand_on(self, tokens: list[int]) -> bool:
        """Gives the hop's handler its tokens (the first only, once, for `on_first_token`); False when it has
        none (any more)."""
        with self._hand_lock:
            hand = self._hand
            if hand is None:
                return False
            if not self._hand_all:
                self._hand, tokens = None, tokens[:1]
            try:
                hand(tokens)
            except Exception as exc:  # noqa: BLE001 - raised in the caller, as its own fault, not in the stream's reader
                self.results_queue.put(exc)
            return True

    def leave(self) -> None:
        """The caller is done with the hop's responses: no token is handed on after this returns."""
        with self._hand_lock:
            self._hand = None

    def close(self) -> None:
        """Stops listening: after the final response, or when the engine will not give one."""
        self.stream.forget(self.request_id, self._on_response)
        if self.own_stream:
            self.stream.close()

    def end(self, timeout_s: float) -> None:
        """Closes a hop cut short (cancelled, failed) once the engine has ended its request, which the
        `stop` sent after it makes happen at once; gives up after `timeout_s`, or at once when an instance
        died. Nothing is cancelled by the transport: a shared gRPC stream cannot cancel one request, and
        cancelled streams are what crashed Triton 2.51 servers under load (README, Known problems)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and all(self.liveness.alive(pid) for pid in self.pids):
            try:
                if self.results_queue.get(timeout=CANCEL_CHECK_S) is _DONE:
                    break
            except queue.Empty:
                pass
        self.close()

    def results(self, timeout_s: float, cancelled):
        """Yields (output_ids, context_phase_params) per non-empty response (with `on_tokens`, only those with
        params); checks cancellation every 50 ms; fails once no response came for `timeout_s`."""
        check = cancel_board.Throttle(CANCEL_CHECK_S, due_now=False)
        while True:
            try:
                item = self.results_queue.get(timeout=CANCEL_CHECK_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if check.due():  # every CANCEL_CHECK_S, tokens or not
                with STUB_LOCK:
                    is_cancelled = cancelled()
                if is_cancelled:
                    raise Cancelled()
                dead = [f"{instance} (pid {pid})" for pid, instance in self.pids.items() if not self.liveness.alive(pid)]
                if dead:
                    raise HopError(f"{self.model}: engine instance {', '.join(dead)} died while serving this request", engine_away=True)
            if item is None:
                if now > self.last_response + timeout_s:
                    raise HopError(f"{self.model}: no response within {timeout_s:g} s")
                continue
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            yield item

    def wait(self, timeout_s: float, cancelled) -> None:
        """Until the hop's end, its tokens handed on (`on_tokens`); raises as `results` does."""
        for _ in self.results(timeout_s, cancelled):
            pass
