"""The orchestrator: prefill -> decode per request, streamed, many requests per instance.

A decoupled Python model in the place of upstream's disaggregated BLS. It reaches the engine models
through the engine server's own HTTP (or gRPC) endpoint (see `Hop` for why not BLS). Where the upstream BLS blocks on
one request at a time and throws the context phase's token away, this one:
- serves each request on its own worker thread, up to `max_in_flight`, `execute` having sent its
  first hop while a worker is free (`_accept`), its responses sent at once while the stub is free, else
  queued for one thread that sends them in turn (disagg.triton.response_thread);
- streams the context phase's first token the moment prefill returns it (TTFT = prefill), from the
  stream's reader thread without waiting for the request's worker to wake (`Hop`), and drops
  the copy of it that every generation-only response stream starts with (TensorRT-LLM re-adds it), so
  the client sees each token once;
- knows that a context-only request the context phase already ends has no `context_phase_params`, so
  the tensorrtllm backend answers it with an error: a one-token request goes to prefill whole
  (context_and_generation), and one whose first token is end_id is asked again that way;
- sends each phase to the least loaded engine instance (every instance is a model of its own: fewest
  sequences in flight, then most free KV blocks, as the reference engines publish on the load board);
  an engine model whose `engine_urls` entry names a pool (disagg.triton.replicas) is served by each of
  the pool's live replicas, and each replica counts as an instance, with the load its metrics publish;
  with service classes, a request goes to the cheapest pool predicted to meet its class instead
  (disagg.triton.sla; `pool_routing` least_loaded or round_robin ignore the class, as baselines);
- gives each hop a deadline (`prefill_timeout_s`, `decode_timeout_s`: longest wait for the next
  response) with an error that names the hop, and fails it within CANCEL_CHECK_S when the engine
  instance serving it dies (its process, as the load board names it, is gone);
- on client cancellation, a hop error or a timeout, sends `stop` for the request id to the engine
  models it reached (a `stop` acts only on the instance it lands on), which frees its KV where it is
  still running or queued; a handoff that no decode was seen to take is drained (a generation request
  takes it and stops after one token), since the backend cannot stop a context-only request that has
  answered.
Mode "aggregated" sends the request to one engine as context_and_generation through the same path,
so the baseline pays the same front-end costs.

Every response carries the tokens produced since the last one, preceded by up to `PREFIX_TOKENS`
earlier tokens (`prefix_length` says how many), so postprocessing can finish a UTF-8 character that
straddles two responses without keeping state. The last response is marked `is_final` (a streamed one
carries no new tokens), so bytes of a character the generation never finished come out as U+FFFD,
as `tokenizer.decode` gives them. A response every CANCEL_CHECK_S also names the request's cancel flag
(`stream_id`, see `cancel_board`): through the ensemble, postprocessing is the only model that learns of
a client's cancellation, and it checks when a response names the flag.
"""
from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.engine.kv_cache import block_hashes
from disagg.triton import cancel_board, credential, kv_index, load_board, replicas, sla
from disagg.triton.contract import (
    CONTEXT_PARAMS_MISSING, DEFAULT_ENGINE_URL, ENGINE_URL_ENV, ENGINE_URLS_ENV, FORWARDED_INPUTS, parse_engine_urls, parse_input_names,
    rename_inputs,
)
from disagg.triton.engine_request import EngineGone, EngineRequest
from disagg.triton.transport import EngineStreams, Server, connect
from disagg.triton.metrics import STUB_LOCK, TPOT_BUCKETS, TTFT_BUCKETS, Metrics, Updater
from disagg.triton.paths import model_param, repository_root
from disagg.triton.response_thread import ResponseThread

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREFIX_TOKENS = 4
_DONE = object()
SENT = object()  # what `_serve` yields once the request's first hop is on its way (`_accept`)
CANCEL_CHECK_S = 0.05
# A client that calls an orchestrator itself (not through an ensemble) cancels on its response sender; asking
# is an IPC round trip, so it is asked less often than the cancel flag is looked at.
SENDER_CHECK_S = 0.25
STOP_TIMEOUT_S = 5.0  # for a `stop` or a drain: cleanup, never on a client's path
DRAIN_WAIT_S = 10.0  # how long a drain waits for a dead decode to be reloaded (else the lease reclaims)
# What Triton core answers for a model it has not loaded (model_repository_manager.cc): an engine server
# that has just been restarted, before its model is back.
MODEL_NOT_LOADED = "Request for unknown model"
# Inputs the orchestrator reads for itself, not forwarded: the client's `stream`, and `exclude_input_in_output`
# (engines always stream to the orchestrator, so the prompt is put before a non-streamed answer here).
OWN_INPUTS = ("streaming", "exclude_input_in_output", "service_class")
READ_INPUTS = frozenset((*FORWARDED_INPUTS, *OWN_INPUTS))


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


@dataclass
class Reached:
    """Where a request went: the engines it reached (for `stop`), and the `context_phase_params` of a
    handoff that no generation request has been seen to take yet."""

    engines: list[Engine] = field(default_factory=list)
    handoff: np.ndarray | None = None


class Cancelled(Exception):
    pass


def _scalar(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


class Hop:
    """One call to an engine model, its responses handed over through a queue so the caller can time out
    and notice cancellation while the engine works.

    Engines are reached through the engine server's own endpoints rather than BLS: in Triton 2.51
    concurrent decoupled BLS streams corrupt the python backend's heap (seen as `malloc(): unaligned
    fastbin chunk detected` and stub segfaults), while client calls are a well-trodden path. Over HTTP each
    call has a connection of its own (disagg.triton.engine_http); over gRPC it goes on the engine server's
    shared stream (disagg.triton.engine_stream), or on a stream of its own (`own_stream`) for a `stop`,
    which reuses the id of the request it stops.

    `pids`: the processes of the model's instances when the hop began (from the load board). If one of
    them dies, the hop fails at the next check, naming it, instead of waiting out its timeout: Triton
    never answers a request whose stub was killed.

    `on_first_token`: called with the hop's first token on the stream's reader thread, before the caller
    gets it: the context phase's token goes to the client without waiting for the request's worker to wake
    (0.16-0.19 ms at one stream, more when the workers queue for the GIL). Never once the caller has left
    the hop (`leave`), whose answer may then be out."""

    def __init__(self, stream: EngineStreams, engine: Engine, inputs: dict[str, np.ndarray], request_id: str,
                 request_type: str, key: str, liveness: load_board.Liveness, pids: dict[int, str] | None = None,
                 own_stream: bool = False, on_first_token: Callable[[int], None] | None = None):
        self.model, self.request_id = engine.name, request_id
        self.liveness, self.pids = liveness, pids or {}
        self.results_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.stream, self.own_stream = stream, own_stream
        self.on_first_token = on_first_token
        self._first_lock = threading.Lock()  # held while on_first_token runs, so `leave` waits it out
        request = EngineRequest(engine.model, request_id, inputs, {"request_type": request_type, credential.PARAMETER: key})
        try:
            stream.send(request, self._on_response)
        except ConnectionError as exc:
            raise HopError(f"{engine.name}: {exc}", engine_away=True) from None

    def _on_response(self, result, error: str | None, final: bool) -> None:
        if error is not None:  # the server went away (EngineGone), or it or its engine refused
            away = isinstance(error, EngineGone) or MODEL_NOT_LOADED in error
            self.results_queue.put(HopError(f"{self.model}: {error}", engine_away=away))
        else:
            ids, params = result.as_numpy("output_ids"), result.as_numpy("context_phase_params")
            if ids is not None or params is not None:
                tokens = [] if ids is None else ids.reshape(-1).tolist()
                if tokens and self.on_first_token is not None:
                    self._first(tokens[0])
                self.results_queue.put((tokens, params))
        if final:
            self.results_queue.put(_DONE)

    def _first(self, token: int) -> None:
        with self._first_lock:
            on_first_token, self.on_first_token = self.on_first_token, None
            if on_first_token is None:
                return
            try:
                on_first_token(token)
            except Exception as exc:  # noqa: BLE001 - raised in the caller, as its own fault, not in the stream's reader
                self.results_queue.put(exc)

    def leave(self) -> None:
        """The caller is done with the hop's responses: `on_first_token` is not called after this returns."""
        with self._first_lock:
            self.on_first_token = None

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

    def results(self, timeout_s: float, cancelled, coalesce_backlog: int = 0):
        """Yields (output_ids, context_phase_params) per non-empty response; checks cancellation every 50 ms.
        With `coalesce_backlog`, once that many responses wait behind the caller, all waiting ones are yielded
        together (their tokens in order, the last params): a consumer that has fallen behind gets fewer,
        fuller responses instead of falling further behind, while one that keeps up gets them one by one."""
        deadline = time.monotonic() + timeout_s
        check = cancel_board.Throttle(CANCEL_CHECK_S, due_now=False)
        held = None  # the end or an error found while coalescing: handled after the tokens before it
        while True:
            if held is not None:
                item, held = held, None
            else:
                try:
                    item = self.results_queue.get(timeout=CANCEL_CHECK_S)
                except queue.Empty:
                    item = None
            if coalesce_backlog and isinstance(item, tuple) and self.results_queue.qsize() >= coalesce_backlog:
                item, held = self._coalesce(item)
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
                if now > deadline:
                    raise HopError(f"{self.model}: no response within {timeout_s:g} s")
                continue
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            deadline = now + timeout_s
            yield item

    def _coalesce(self, first: tuple[list[int], np.ndarray | None]):
        """`first` merged with the token responses already waiting; returns it and the item that stopped
        the merge (the end, an error) or None."""
        tokens, params = first
        while True:
            try:
                item = self.results_queue.get_nowait()
            except queue.Empty:
                return (tokens, params), None
            if not isinstance(item, tuple):
                return (tokens, params), item
            tokens = tokens + item[0]
            params = item[1] if item[1] is not None else params


class ClientStream:
    """What the client gets: token responses (streamed, or one at the end) with a UTF-8 prefix."""

    def __init__(self, out: ResponseThread, sender, streaming: bool, stream_id: str, paced: bool = False):
        self.out, self.sender = out, sender
        # paced: each response waits for the one before it to be sent, so a stream that Triton sends slower
        # than its engine answers lets the engine's responses wait in its hop, where they are coalesced
        self.previous_sent = threading.Event() if paced else None
        if self.previous_sent is not None:
            self.previous_sent.set()
        self.streaming = streaming
        self.stream_id = stream_id.encode()
        self.tokens: list[int] = []
        self.sent = 0
        self.check = cancel_board.Throttle(CANCEL_CHECK_S)

    def emit(self, tokens: list[int]) -> None:
        self.tokens += tokens
        if self.streaming and tokens:
            self._send(self.sent, final=False)

    def _send(self, start: int, final: bool) -> None:
        prefix = max(0, start - PREFIX_TOKENS)
        ids = self.tokens[prefix:]
        then = None
        if self.previous_sent is not None:
            self.previous_sent.wait()
            self.previous_sent.clear()
            then = self.previous_sent.set
        self.out.send(self.sender, self._outputs(ids, start - prefix, final), FINAL if final else 0, then)
        self.sent = len(self.tokens)

    def _outputs(self, ids: list[int], prefix_length: int, final: bool) -> dict[str, np.ndarray]:
        """One response's tensors: `ids`, the first `prefix_length` of them sent before."""
        return {
            "output_ids": np.asarray(ids, dtype=np.int32).reshape(1, 1, -1),
            "sequence_length": np.asarray([[len(ids)]], dtype=np.int32),
            "prefix_length": np.asarray([[prefix_length]], dtype=np.int32),
            "is_final": np.asarray([[final]], dtype=np.bool_),
            # postprocessing asks Triton about cancellation only when a response names the flag
            "stream_id": np.asarray([[self.stream_id if self.check.due() else b""]], dtype=object),
        }

    def finish(self) -> None:
        """Streamed: a last response with no new tokens, which flushes a held-back partial character.
        Otherwise the whole answer in one response, even when it is empty."""
        self._send(self.sent if self.streaming else 0, final=True)

    def fail(self, message: str) -> None:
        self.out.fail(self.sender, message)


class TritonPythonModel:
    read_inputs = READ_INPUTS  # of a request: the rest is not copied

    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"model {config['name']!r} must be decoupled")
        self.mode = model_param(args, "mode")
        if self.mode == "aggregated":
            self.engines = [model_param(args, "aggregated_model_name")]
            self.prefills, self.decoders = [], []
        else:
            self.prefills = model_param(args, "context_model_name").split(",")
            self.decoders = model_param(args, "generation_model_name").split(",")
            self.engines = [*self.prefills, *self.decoders]
        self.board_key = load_board.board_key(repository_root(args))
        self.board = load_board.BoardView(self.board_key).start()
        self.liveness = load_board.Liveness()
        self.internal_key = credential.internal_key(self.board_key)
        self.instance = args["model_instance_name"]
        cancel_board.remove_leftovers(self.board_key, self.instance)
        local = os.environ.get(ENGINE_URL_ENV, DEFAULT_ENGINE_URL)
        # The spec's engine_urls (pools on other nodes) first, then the engine servers disagg-serve runs.
        remote = {**parse_engine_urls(os.environ.get(ENGINE_URLS_ENV, "")), **parse_engine_urls(model_param(args, "engine_urls"))}
        self.engine_urls = {model: remote.get(model, local) for model in self.engines}
        self.input_names = parse_input_names(model_param(args, "engine_input_names"))
        self.dispatched: dict[Engine, int] = {}
        self.prefill_routing = model_param(args, "prefill_routing")
        self.pool_routing = model_param(args, "pool_routing")
        self._turn = 0  # pool_routing: round_robin
        self.coalesce_backlog = int(model_param(args, "coalesce_backlog"))
        self.kv_index = kv_index.IndexReader(self.board_key)
        self.rng = random.Random(0)
        self.prefill_timeout_s = float(model_param(args, "prefill_timeout_s"))
        self.decode_timeout_s = float(model_param(args, "decode_timeout_s"))
        self.max_in_flight = int(model_param(args, "max_in_flight"))
        self.workers = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="request")
        self.out = ResponseThread(self.instance)
        self.closer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hop-close")
        self.servers: dict[str, Server] = {}  # by URL
        self.retired: list[Server] = []  # of replicas that left (`retire`d, closed at finalize)
        self.metrics = Metrics(f"orchestrator-{self.mode}", self.instance, Updater())
        self.ttft = self.metrics.histogram("disagg_ttft_seconds", "Request arrival at the orchestrator -> first token sent", TTFT_BUCKETS)
        self.in_flight = self.metrics.gauge("disagg_orchestrator_in_flight", "Requests the orchestrator is serving")
        self.failures = self.metrics.counter("disagg_orchestrator_failures_total", "Requests ended by an error or timeout")
        self.cancels = self.metrics.counter("disagg_orchestrator_cancelled_total", "Requests cancelled by the client")
        self._count = 0
        self._handed = 0  # requests handed to the workers and not yet served: a worker is free while < max_in_flight
        self._lock = threading.Lock()
        # A model's engine_urls value names one server, or pools: "source[;cost=N]|source[;cost=N]...".
        self.pools: dict[str, replicas.ReplicaPool] = {}  # by source
        self.pools_of: dict[str, list[str]] = {}  # model -> the sources of the pools that serve it
        self.costs: dict[str, float] = {}  # source -> relative cost of a hop there (default 1)
        for model, url in self.engine_urls.items():
            for part in url.split("|"):
                value, _, options = part.partition(";")
                source = replicas.parse_source(value)
                if source is None:
                    continue
                if value not in self.pools:
                    self.pools[value] = replicas.ReplicaPool(source, on_leave=self._replica_left)
                    self.costs[value] = float(options.removeprefix("cost=")) if options.startswith("cost=") else 1.0
                self.pools_of.setdefault(model, []).append(value)
        self.classes = sla.parse_classes(model_param(args, "service_classes"))
        self.default_class = model_param(args, "default_service_class")
        self.strictest = {phase: min((t for c in self.classes.values() if (t := c.target(phase))), default=None)
                          for phase in ("prefill", "decode")}
        self.speeds: dict[str, dict[str, sla.Speed]] = {"prefill": {}, "decode": {}}  # phase -> {pool or url: speed}
        # What class routing sees, for an operator: each pool's measured hops (labelled with its source or
        # URL) and each class's refusals.
        phase_models = {"prefill": self.prefills or self.engines, "decode": self.decoders or self.engines}
        self.hop_seconds = {
            (phase, site): self.metrics.histogram(f"disagg_pool_{metric}_seconds", f"{what}, as service-class routing measures it",
                                                  buckets, {"pool": site})
            for phase, metric, what, buckets in (("prefill", "ttft", "Time to first token of a hop to the pool", TTFT_BUCKETS),
                                                 ("decode", "tpot", "Time per output token of a hop to the pool", TPOT_BUCKETS))
            for site in dict.fromkeys(s for m in phase_models[phase] for s in self.pools_of.get(m, [self.engine_urls[m]]))
        } if self.classes else {}
        self.refused = {name: self.metrics.counter("disagg_service_class_refused_total", "Requests refused before any work: no pool "
                                                   "was predicted to meet their class", {"service_class": name}) for name in self.classes}

    def execute(self, requests):
        """Starts each request and hands it to a worker, without the stub's lock. Its calls (inputs,
        parameters, the response sender) are the ones an engine model's execute makes while that model's
        delivery thread sends responses, never under a lock. Taking the lock here made every arriving request
        wait out the response thread's batch of sends: 19 ms an execute at 64 streams, while Triton held the
        next request."""
        self._accept(requests)
        return None

    def _accept(self, requests) -> None:
        """`_serve` runs here up to its first hop's send when a worker is free to take the rest at once: the
        request's first token then waits for no worker to wake (0.16 ms at one stream, docs/measurements.md).
        With every worker taken (`_handed`), the request waits for one before it does anything, prefill
        included, so no more than `max_in_flight` requests hold KV."""
        for request in requests:
            arrays = self._copy_inputs(request)
            if "service_class" not in arrays:  # else the request parameter of that name (an ensemble passes them on)
                named = json.loads(request.parameters() or "{}").get("service_class")
                if named is not None:
                    arrays["service_class"] = np.asarray([[str(named).encode()]], dtype=object)
            serving = self._serve(arrays, request.get_response_sender(), time.monotonic())
            with self._lock:
                worker_free = self._handed < self.max_in_flight
                self._handed += 1
            try:
                if worker_free:
                    next(serving, None)
            finally:
                self.workers.submit(self._run_out, serving)

    def _run_out(self, serving: Iterator[object]) -> None:
        """A request's worker: serves what `_accept` left of it."""
        try:
            for _ in serving:
                pass
        finally:
            with self._lock:
                self._handed -= 1

    def _copy_inputs(self, request) -> dict[str, np.ndarray]:
        """The request's inputs this model reads, copied: its tensors are released once execute returns."""
        arrays = {}
        for tensor in request.inputs():
            array = self._copy_input(tensor.name(), tensor)
            if array is not None:
                arrays[tensor.name()] = array
        return arrays

    def _copy_input(self, name: str, tensor) -> np.ndarray | None:
        """One input as this model keeps it (None: not kept)."""
        return tensor.as_numpy().copy() if name in self.read_inputs else None

    def _client_stream(self, sender, streaming: bool, stream_id: str) -> ClientStream:
        return ClientStream(self.out, sender, streaming, stream_id, paced=self.coalesce_backlog > 0)

    def _cancel_flag(self, request_id: str) -> cancel_board.CancelFlag | cancel_board.NoFlag:
        """Where postprocessing tells of a client's cancellation (through an ensemble it alone hears of it)."""
        return cancel_board.CancelFlag(self.board_key, self.instance, request_id)

    def _serve(self, arrays: dict[str, np.ndarray], sender, arrival: float) -> Iterator[object]:
        """Serves one request; yields SENT when a hop of it is on its way (never, when it ends before one), so
        that `_accept` can run it up to its first hop's send and a worker the rest."""
        request_id = uuid.uuid4().hex
        flag = self._cancel_flag(request_id)
        streaming = arrays.pop("streaming", None)
        service_class = arrays.pop("service_class", None)
        client = self._client_stream(sender, bool(streaming is not None and streaming.reshape(-1)[0]), flag.stream_id)
        exclude = arrays.pop("exclude_input_in_output", None)
        if exclude is not None and not exclude.reshape(-1)[0] and not client.streaming:
            # As the tensorrtllm backend: a non-streamed answer then starts with the prompt's tokens (TB
            # model_instance_state.cc: "initial tokens sent by the executor are the input tokens IF NOT
            # Streaming"); a streamed one never has them (TL llmRequest.cpp createResult counts streamed
            # tokens from getMaxSentTokenLen(), which starts at the prompt length).
            client.emit(arrays["input_ids"].reshape(-1)[: int(arrays["input_lengths"].reshape(-1)[0])].tolist())
        inputs = {**rename_inputs(arrays, self.input_names), "streaming": _scalar(True, np.bool_)}
        reached = Reached()

        sender_check = cancel_board.Throttle(SENDER_CHECK_S, due_now=False)

        def cancelled() -> bool:
            return flag.is_raised() or (sender_check.due() and sender.is_cancelled())

        completed = False
        self._track(+1)  # here, where the finally that counts it out begins
        try:
            try:
                klass = self._service_class(service_class)  # checked on every path
                if self.pool_routing != "service_class":
                    klass = None  # checked, not routed by: a baseline
                if self.mode == "aggregated":
                    if klass is not None:
                        engine, at = self._admit(klass, lambda: self._pick_for(self.engines, klass, ("prefill", "decode")))
                    else:
                        engine, at = self._pick(self.engines), None
                    reached.engines.append(engine)
                    try:
                        yield from self._context_and_generation(engine, inputs, request_id, client, cancelled, arrival, measured_at=at)
                    finally:
                        self._done(engine)
                else:
                    yield from self._disaggregated(request_id, inputs, client, cancelled, arrival, reached, klass)
                client.finish()
                completed = True
            except Cancelled:
                self.cancels.increment(1)
                self._quietly(client.finish)
            except HopError as exc:
                message = str(exc)
                self.failures.increment(1)
                self._quietly(lambda: client.fail(message))  # first: a hung engine must not delay the error
                with STUB_LOCK:
                    pb_utils.Logger.log_warn(f"{self.instance}: request {request_id} failed: {message}")
            except Exception as exc:  # noqa: BLE001 - a fault of ours: the client must still get its final answer, and the worker would swallow it
                message = f"{self.instance}: internal error: {type(exc).__name__}: {exc}"
                self.failures.increment(1)
                self._quietly(lambda: client.fail(message))
                with STUB_LOCK:
                    pb_utils.Logger.log_error(f"{self.instance}: request {request_id}: {traceback.format_exc()}")
            finally:
                flag.close()  # the client has its answer: nothing reads the flag any more
        finally:
            try:
                if not completed:  # after the answer: a hung engine may make this take STOP_TIMEOUT_S
                    self._release(request_id, inputs, reached)
            finally:
                self._track(-1)

    def _disaggregated(self, request_id: str, inputs: dict[str, np.ndarray], client: ClientStream, cancelled, arrival: float,
                       reached: Reached, klass: sla.ServiceClass | None) -> Iterator[object]:
        self._check_live(self.decoders)  # no prefill work (and KV to hand off) for a request no decode can take
        if klass is None:
            prefill, at_prefill = self._pick_prefill(inputs["input_ids"].reshape(-1)[: int(inputs["input_lengths"].reshape(-1)[0])]), 0
        else:
            self._admit(klass, lambda: self._choose(self.decoders, klass, ("decode",)))  # refused now if no decode pool meets it
            prefill, at_prefill = self._admit(klass, lambda: self._pick_for(self.prefills, klass, ("prefill",)))
        reached.engines.append(prefill)
        started = time.monotonic()
        try:
            if int(inputs["request_output_len"].reshape(-1)[0]) <= 1:  # the context phase is all of it
                yield from self._context_and_generation(prefill, inputs, request_id, client, cancelled, arrival)
                return

            def first_out(token: int) -> None:  # on the prefill stream's reader thread
                client.emit([token])
                self.ttft.observe(time.monotonic() - arrival)

            try:
                with self._hop(prefill, inputs, request_id, "context_only", on_first_token=first_out) as hop:
                    yield SENT
                    context = list(hop.results(self.prefill_timeout_s, cancelled))
                self._observe("prefill", prefill, at_prefill, time.monotonic() - started)
            except HopError as exc:
                if CONTEXT_PARAMS_MISSING not in str(exc):
                    raise
                # The first token ended the request (end_id): a context-only request has no params then, and
                # the backend answers with this error. Ask for that one token as a whole request instead.
                one = {**inputs, "request_output_len": _scalar(1, np.int32)}
                yield from self._context_and_generation(prefill, one, request_id, client, cancelled, arrival)
                return
        finally:
            self._done(prefill)
        tokens = [t for ids, _ in context for t in ids]
        params = next((p for _, p in reversed(context) if p is not None), None)
        if params is None or not tokens:
            raise HopError(f"{prefill.name}: context-only response without its first token and context_phase_params")
        reached.handoff = params  # its first token is out (`first_out`)
        with STUB_LOCK:
            if cancelled():
                raise Cancelled()
        decode, at_decode = None, (None if klass is None else 0)  # at_decode: None when not measured for class routing
        if klass is not None:  # the first token is out: the class picks the pool, but no longer refuses
            with contextlib.suppress(sla.NoPoolMeets):
                decode, at_decode = self._pick_for(self.decoders, klass, ("decode",))
        decode = decode or self._pick_decode()
        reached.engines.append(decode)
        first_at, tokens = None, 0
        try:
            with self._hop(decode, {**inputs, "context_phase_params": params.reshape(1, -1)}, request_id, "generation_only") as hop:
                # A generation-only request returns the context phase's token again (TensorRT-LLM re-adds
                # it; the reference engine does the same): the client already has it.
                skip = 1
                for ids, _ in hop.results(self.decode_timeout_s, cancelled, self.coalesce_backlog):
                    reached.handoff = None  # decode answers once it has the KV
                    client.emit(ids[skip:])
                    if ids[skip:]:
                        first_at = first_at or time.monotonic()
                        tokens += len(ids[skip:])
                        self._probe_tpot(decode, at_decode, first_at, tokens - len(ids[skip:]), tokens)
                    skip = max(0, skip - len(ids))
            self._probe_tpot(decode, at_decode, first_at, tokens, tokens, ended=True)
        finally:
            self._done(decode)

    def _service_class(self, value: np.ndarray | None) -> sla.ServiceClass | None:
        """The request's class: its `service_class` input or request parameter, else the spec's default; None
        without classes."""
        name = value.reshape(-1)[0] if value is not None else b""
        name = (name.decode(errors="replace") if isinstance(name, bytes) else str(name)) or self.default_class
        if not name:
            return None
        if name not in self.classes:
            known = ", ".join(self.classes) or "none: orchestrator.service_classes is not set"
            raise HopError(f"service_class: {name!r} is not a service class of this deployment ({known})")
        return self.classes[name]

    def _admit(self, klass: sla.ServiceClass, choice):
        """`choice()`; a NoPoolMeets from it refuses the request (counted for its class)."""
        try:
            return choice()
        except sla.NoPoolMeets as exc:
            self.refused[klass.name].increment(1)
            raise HopError(str(exc)) from None

    def _choose(self, models: list[str], klass: sla.ServiceClass, phases: tuple[str, ...]) -> tuple[Engine, int]:
        """Where a hop of `klass` goes (disagg.triton.sla) and the requests in flight there: a hop of one
        phase, or of both on an aggregated engine. sla.NoPoolMeets when no pool is predicted to meet the
        class. The caller dispatches it."""
        candidates = self._candidates(models)
        with self._lock:
            scored = [(e, self._score(e)) for e in candidates]
            live = [(e, s) for e, s in scored if not s[0]] or scored
            options = [sla.Option(e, e.site, self.costs.get(e.pool, 1.0), s[1], s) for e, s in live]
        option = sla.choose(options, klass, [sla.Phase(p, self.speeds[p], self.strictest[p]) for p in phases],
                            "aggregated" if len(phases) > 1 else phases[0])
        return option.key, option.in_flight

    def _pick_for(self, models: list[str], klass: sla.ServiceClass, phases: tuple[str, ...]) -> tuple[Engine, int]:
        """`_choose`, dispatched (until `_done`)."""
        engine, in_flight = self._choose(models, klass, phases)
        with self._lock:
            return self._dispatch(engine), in_flight

    def _observe(self, phase: str, engine: Engine, in_flight: int, seconds: float) -> None:
        """What a hop took, for its pool's (or server's) speed: TTFT of a prefill hop against the requests
        in flight there when it was sent (itself included), TPOT of a decode one against the mean of that
        and those in flight as it ends (disagg.triton.sla). Called before the hop's `_done`."""
        if not self.classes:
            return
        load = in_flight + 1
        if phase == "decode":
            with self._lock:
                load = (load + self._score(engine)[1]) / 2
        self.speeds[phase].setdefault(engine.site, sla.Speed()).observe(load, seconds)
        if (phase, engine.site) in self.hop_seconds:
            self.hop_seconds[(phase, engine.site)].observe(seconds)

    def _probe_tpot(self, engine: Engine, measured_at: int | None, first_at: float | None, before: int, after: int,
                    ended: bool = False) -> None:
        """Measures a hop's time per output token once, for class routing (`measured_at` None: not routed
        by class): as its token count passes sla.PROBE_TOKENS (a slow pool is known within a few of its
        steps), or when it ends shorter than that."""
        if measured_at is None or after < 2:
            return
        if before <= sla.PROBE_TOKENS < after or (ended and after <= sla.PROBE_TOKENS):
            self._observe("decode", engine, measured_at, (time.monotonic() - first_at) / (after - 1))

    def _context_and_generation(self, engine: Engine, inputs: dict[str, np.ndarray], request_id: str, client: ClientStream, cancelled,
                                arrival: float, measured_at: int | None = None) -> Iterator[object]:
        """The whole request on one engine, streamed: the aggregated path, and a one-token disaggregated one.
        With `measured_at` (the requests in flight there when it was routed by class) its TTFT and TPOT
        are what the engine's pool is measured by."""
        started, first_at, count = time.monotonic(), None, 0
        with self._hop(engine, inputs, request_id, "context_and_generation") as hop:
            yield SENT
            for tokens, _ in hop.results(self.decode_timeout_s, cancelled, self.coalesce_backlog):
                if first_at is None and tokens:
                    first_at = time.monotonic()
                    self.ttft.observe(first_at - arrival)
                    if measured_at is not None:
                        self._observe("prefill", engine, measured_at, first_at - started)
                client.emit(tokens)
                count += len(tokens)
                self._probe_tpot(engine, measured_at, first_at, count - len(tokens), count)
        self._probe_tpot(engine, measured_at, first_at, count, count, ended=True)

    def _candidates(self, models: list[str]) -> list[Engine]:
        """Every engine that can serve one of `models`: its server, or each live replica of its pool.
        When none is live, the pools are read again at once (a replica may have joined since their last
        reading, as at start); HopError when there is still none."""
        found = self._listed(models)
        if not found:
            for source in dict.fromkeys(s for m in models for s in self.pools_of[m]):
                self.pools[source].refresh()
            found = self._listed(models)
        if not found:
            sources = ", ".join(sorted({self.engine_urls[m] for m in models}))
            raise HopError(f"{'/'.join(models)}: no replica is serving ({sources}): retry shortly", engine_away=True)
        return found

    def _listed(self, models: list[str]) -> list[Engine]:
        """The engines serving `models` as last read: a model's own server, or each live replica of its pools."""
        found = []
        for model in models:
            sources = self.pools_of.get(model)
            if sources is None:
                found.append(Engine(model, self.engine_urls[model]))
            else:
                found += [Engine(model, url, source) for source in sources for url in self.pools[source].urls()]
        return found

    def _score(self, engine: Engine) -> tuple[bool, int, int]:
        """(known dead, sequences in flight, -free KV blocks): from the load board for a model's own
        server, from the replica's metrics for a pool's; what this orchestrator dispatched and still streams
        counts even before either shows it. The caller holds `_lock`."""
        dispatched = self.dispatched.get(engine, 0)
        if not engine.replica:
            return load_board.load_score(self.board, engine.model, dispatched)
        load = self.pools[engine.pool].load(engine.url, engine.model)
        if load is None:  # it left the pool since the candidates were listed
            return True, dispatched, 0
        return False, max(load.active, dispatched), -load.free_blocks

    def _pick(self, models: list[str], candidates: list[Engine] | None = None) -> Engine:
        """The least loaded engine serving one of `models` (of `candidates`, when the caller listed them);
        counted as dispatched until `_done`."""
        candidates = candidates or self._candidates(models)
        with self._lock:
            return self._dispatch(min(candidates, key=self._score))

    def _pick_decode(self) -> Engine:
        """A decode hop without class routing: the least loaded engine, or each in turn (pool_routing:
        round_robin, a baseline that ignores load and speed)."""
        if self.pool_routing != "round_robin":
            return self._pick(self.decoders)
        candidates = sorted(self._candidates(self.decoders), key=lambda e: (e.pool, e.url, e.model))
        with self._lock:
            self._turn += 1
            return self._dispatch(candidates[self._turn % len(candidates)])

    def _dispatch(self, engine: Engine) -> Engine:
        """Counts `engine` as dispatched (until `_done`); the caller holds `_lock`."""
        self.dispatched[engine] = self.dispatched.get(engine, 0) + 1
        return engine

    def _pick_prefill(self, prompt: np.ndarray) -> Engine:
        """`least_loaded` as `_pick`; `random`; or `cache_aware` (the default): the prefill instance that
        would have the least to do, counting the prompt blocks it must compute (those past the longest
        prefix it holds cached, disagg.triton.kv_index) plus a whole prompt for each request it already has
        in flight, as Dynamo's KV router weighs overlap against load."""
        candidates = self._candidates(self.prefills)
        if self.prefill_routing == "cache_aware" and len(candidates) > 1:
            costs = self._cache_aware_costs(prompt, candidates)
            if costs:  # else every instance is known dead: the least loaded, which `_hop` then refuses by name
                with self._lock:
                    return self._dispatch(min(costs, key=costs.get))
        elif self.prefill_routing == "random":
            with self._lock:
                return self._dispatch(self.rng.choice(candidates))
        return self._pick(self.prefills, candidates)

    def _cache_aware_costs(self, prompt: np.ndarray, candidates: list[Engine]) -> dict[Engine, int]:
        """{prefill engine not known dead: prompt blocks to compute there + a whole prompt per request in
        flight}. A pool's replicas publish no cache index here: for them the prompt counts whole."""
        costs, hashes_of = {}, {}  # hashes per block size: instances usually share one
        for engine in candidates:
            with self._lock:
                dead, in_flight, _ = self._score(engine)
            if dead:
                continue
            tpb, held = (0, set()) if engine.replica else self.kv_index.held(engine.model)
            if tpb not in hashes_of:
                hashes_of[tpb] = block_hashes(prompt[:-1].tolist(), tpb) if tpb else []
            hashes = hashes_of[tpb]
            matched = next((i for i, h in enumerate(hashes) if h not in held), len(hashes))
            blocks = max(1, len(hashes))
            costs[engine] = (blocks - matched) + in_flight * blocks
        return costs

    def _done(self, engine: Engine) -> None:
        with self._lock:
            self.dispatched[engine] -= 1
            if self.dispatched[engine] or not engine.replica or engine.url in self.pools[engine.pool].urls():
                return
            del self.dispatched[engine]
        self._replica_left(engine.url)

    def _replica_left(self, url: str) -> None:
        """Lets go of a replica that left its pool once nothing of ours runs there: it cannot stop while a
        stream or connection of ours is open. Until then `_done` calls again as its requests end. Nothing is
        cancelled (`retire`: a gRPC stream is half-closed; an HTTP connection closes with its answer); the server's
        client is closed at finalize."""
        with self._lock:
            if any(e.url == url and n for e, n in self.dispatched.items()):
                return
            for engine in [e for e in self.dispatched if e.url == url]:
                del self.dispatched[engine]
            server = self.servers.pop(url, None)
            if server is not None:
                self.retired.append(server)
        if server is not None:
            server.retire()

    def _release(self, request_id: str, inputs: dict[str, np.ndarray], reached: Reached) -> None:
        """Frees what an ended request holds: `stop` where it went, and a handoff nobody took is drained."""
        self._stop(request_id, reached.engines)
        if reached.handoff is not None:
            self._quietly(lambda: self._drain(request_id, inputs, reached.handoff))

    def _drain(self, request_id: str, inputs: dict[str, np.ndarray], params: np.ndarray) -> None:
        """Has a decode instance take a handoff and stop after one token. The tensorrtllm backend forgets a
        context-only request once it has answered, so a `stop` cannot free its KV: only a generation
        request that takes it can (the reference engine would also reclaim it when its lease runs out)."""
        take = {**inputs, "request_output_len": _scalar(1, np.int32), "context_phase_params": params.reshape(1, -1)}
        deadline = time.monotonic() + DRAIN_WAIT_S
        while True:
            decode = None
            try:
                decode = self._pick(self.decoders)
                with self._hop(decode, take, f"{request_id}-drain", "generation_only") as hop:
                    list(hop.results(STOP_TIMEOUT_S, lambda: False))
                return
            except HopError as exc:  # decode is being reloaded or restarted: wait for it
                if not exc.engine_away or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
            finally:
                if decode is not None:
                    self._done(decode)

    def _stop(self, request_id: str, engines: list[Engine]) -> None:
        """Sends `stop` for the request to each engine it touched, which frees its KV there (held handoff
        included; a no-op where it is gone). A `stop` acts only on the instance it lands on, so every
        engine instance is a model of its own and `engines` names exactly where the request went."""
        stop = {
            "input_lengths": _scalar(0, np.int32),
            "request_output_len": _scalar(1, np.int32),
            "stop": _scalar(True, np.bool_),
        }
        for engine in engines:
            def send_stop(e=engine):
                with self._hop(e, stop, request_id, "context_and_generation", own_stream=True) as hop:
                    list(hop.results(STOP_TIMEOUT_S, lambda: False))

            self._quietly(send_stop)
            if engine.replica and engine.url not in self.pools[engine.pool].urls():
                self._replica_left(engine.url)  # the stop opened its channel again

    @contextlib.contextmanager
    def _hop(self, engine: Engine, inputs: dict[str, np.ndarray], request_id: str, request_type: str, own_stream: bool = False,
             on_first_token: Callable[[int], None] | None = None):
        pids = {} if engine.replica else self._check_live([engine.model])
        server = self._server(engine.url)
        stream = server.open() if own_stream else server.shared(engine.model)
        hop = Hop(stream, engine, inputs, request_id, request_type, self.internal_key, self.liveness, pids, own_stream, on_first_token)
        try:
            yield hop
        except BaseException:
            hop.leave()  # before the client's final answer: no token after it
            self.closer.submit(hop.end, STOP_TIMEOUT_S)  # the engine may never finish the request (timeout, hung engine)
            raise
        hop.leave()
        hop.close()

    def _server(self, url: str) -> Server:
        with self._lock:
            if url not in self.servers:
                self.servers[url] = connect(url)
            return self.servers[url]

    def _check_live(self, models: list[str]) -> dict[int, str]:
        """The live instances' pids of `models` (as published); HopError when instances published and every
        one has died (Triton would hold a request for a dead stub for seconds before refusing it), or when
        no pool of theirs has a live replica."""
        self._candidates(models)
        published = [e for m in models if m not in self.pools_of for e in self.board.entries(m)]
        pids = {e.load.pid: e.instance for e in published if e.process_alive}
        if published and not pids:
            dead = ", ".join(f"{e.instance} (pid {e.load.pid})" for e in published)
            raise HopError(f"{'/'.join(models)}: no live engine instance ({dead} died; it is being reloaded): retry shortly",
                           engine_away=True)
        return pids

    @staticmethod
    def _quietly(fn) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - best effort on paths that already failed or were cancelled
            pass

    def _track(self, delta: int) -> None:
        with self._lock:
            self._count += delta
            self.in_flight.set(self._count)

    def finalize(self):
        cancel_board.remove_leftovers(self.board_key, self.instance)  # of requests cut short by the stop
        self.workers.shutdown(wait=False, cancel_futures=True)
        self.closer.shutdown(wait=False)
        self.out.close()
        self.metrics.updater.close()
        self.metrics.release()
        self.board.close()
        for pool in self.pools.values():
            pool.close()
        with self._lock:
            servers = [*self.servers.values(), *self.retired]
        for server in servers:
            server.close()
