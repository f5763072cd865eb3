"""The orchestrator: prefill -> decode per request, streamed, many requests per instance.

A decoupled Python model in the place of upstream's disaggregated BLS. It reaches the engine models
through the engine server's own HTTP (or gRPC) endpoint (disagg.triton.hop says why not BLS). Where the
upstream BLS blocks on one request at a time and throws the context phase's token away, this one:
- serves each request on its own worker thread, up to `max_in_flight`, `execute` having sent its
  first hop while a worker is free (`_accept`), its responses sent at once while the stub is free, else
  queued for one thread that sends them in turn (disagg.triton.response_thread);
- streams the context phase's first token the moment prefill returns it (TTFT = prefill), and each decode
  token as it comes, from the engine stream's reader thread without waiting for the request's worker to
  wake (`Hop`), and drops the copy of the first token that every generation-only response stream starts
  with (TensorRT-LLM re-adds it), so the client sees each token once;
- knows that a context-only request the context phase already ends has no `context_phase_params`, so
  the tensorrtllm backend answers it with an error: a one-token request goes to prefill whole
  (context_and_generation), and one whose first token is end_id is asked again that way;
- sends each phase where disagg.triton.routing picks: the least loaded engine instance, the prefill
  instance holding most of the prompt cached, a pool's replica, or the cheapest pool predicted to meet
  the request's service class;
- gives each hop a deadline (`prefill_timeout_s`, `decode_timeout_s`: longest wait for the next
  response) with an error that names the hop, and fails it within hop.CANCEL_CHECK_S when the engine
  instance serving it dies (its process, as the load board names it, is gone);
- on client cancellation, a hop error or a timeout, sends `stop` for the request id to the engine
  models it reached (a `stop` acts only on the instance it lands on), which frees its KV where it is
  still running or queued; a handoff that no decode was seen to take is drained (a generation request
  takes it and stops after one token), since the backend cannot stop a context-only request that has
  answered.
Mode "aggregated" sends the request to one engine as context_and_generation through the same path,
so the baseline pays the same front-end costs. What the client gets is disagg.triton.client_stream's.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton import cancel_board, credential, kv_index, load_board, sla
from disagg.triton.client_stream import ClientStream
from disagg.triton.contract import (
    CONTEXT_PARAMS_MISSING, DEFAULT_ENGINE_URL, ENGINE_URL_ENV, ENGINE_URLS_ENV, FORWARDED_INPUTS, parse_engine_urls, parse_input_names,
    rename_inputs,
)
from disagg.triton.hop import Cancelled, Engine, Hop, HopError
from disagg.triton.metrics import FIRST_HOP_BUCKETS, STUB_LOCK, TTFT_BUCKETS, Metrics, Updater
from disagg.triton.paths import model_param, repository_root
from disagg.triton.response_thread import ResponseThread
from disagg.triton.routing import Router

SENT = object()  # what `_serve` yields once the request's first hop is on its way (`_accept`)
# A client that calls an orchestrator itself (not through an ensemble) cancels on its response sender; asking
# is an IPC round trip, so it is asked less often than the cancel flag is looked at.
SENDER_CHECK_S = 0.25
STOP_TIMEOUT_S = 5.0  # for a `stop` or a drain: cleanup, never on a client's path
DRAIN_WAIT_S = 10.0  # how long a drain waits for a dead decode to be reloaded (else the lease reclaims)
# Inputs the orchestrator reads for itself, not forwarded: the client's `stream`, and `exclude_input_in_output`
# (engines always stream to the orchestrator, so the prompt is put before a non-streamed answer here).
OWN_INPUTS = ("streaming", "exclude_input_in_output", "service_class")
READ_INPUTS = frozenset((*FORWARDED_INPUTS, *OWN_INPUTS))


@dataclass
class Reached:
    """Where a request went: the engines it reached (for `stop`), and the `context_phase_params` of a
    handoff that no generation request has been seen to take yet."""

    engines: list[Engine] = field(default_factory=list)
    handoff: np.ndarray | None = None


def _scalar(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


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
        self.liveness = load_board.Liveness()
        self.internal_key = credential.internal_key(self.board_key)
        self.instance = args["model_instance_name"]
        cancel_board.remove_leftovers(self.board_key, self.instance)
        self.input_names = parse_input_names(model_param(args, "engine_input_names"))
        self.coalesce_backlog = int(model_param(args, "coalesce_backlog"))
        self.prefill_timeout_s = float(model_param(args, "prefill_timeout_s"))
        self.decode_timeout_s = float(model_param(args, "decode_timeout_s"))
        self.max_in_flight = int(model_param(args, "max_in_flight"))
        self.workers = ThreadPoolExecutor(max_workers=self.max_in_flight, thread_name_prefix="request")
        self.out = ResponseThread(self.instance)
        self.closer = ThreadPoolExecutor(max_workers=8, thread_name_prefix="hop-close")
        self.metrics = Metrics(f"orchestrator-{self.mode}", self.instance, Updater())
        self.ttft = self.metrics.histogram("disagg_ttft_seconds", "Request arrival at the orchestrator -> first token sent", TTFT_BUCKETS)
        self.first_hop = self.metrics.histogram(
            "disagg_first_hop_seconds", "Request arrival at the orchestrator -> its first engine request sent (validating, "
            "tokenizing, routing, waiting for a worker)", FIRST_HOP_BUCKETS)
        self.in_flight = self.metrics.gauge("disagg_orchestrator_in_flight", "Requests the orchestrator is serving")
        self.failures = self.metrics.counter("disagg_orchestrator_failures_total", "Requests ended by an error or timeout")
        self.cancels = self.metrics.counter("disagg_orchestrator_cancelled_total", "Requests cancelled by the client")
        self._count = 0
        # Request ids: unique across instances and restarts by a random prefix, then counted (uuid4 per request
        # cost a getrandom call on the way to the first hop)
        self._id_prefix, self._ids = uuid.uuid4().hex[:16], itertools.count()
        self._handed = 0  # requests handed to the workers and not yet served: a worker is free while < max_in_flight
        self._lock = threading.Lock()
        local = os.environ.get(ENGINE_URL_ENV, DEFAULT_ENGINE_URL)
        # The spec's engine_urls (pools on other nodes) first, then the engine servers disagg-serve runs.
        remote = {**parse_engine_urls(os.environ.get(ENGINE_URLS_ENV, "")), **parse_engine_urls(model_param(args, "engine_urls"))}
        self.router = Router(
            {model: remote.get(model, local) for model in self.engines}, self.prefills, self.decoders,
            load_board.BoardView(self.board_key).start(), kv_index.IndexReader(self.board_key), self.metrics,
            prefill_routing=model_param(args, "prefill_routing"), pool_routing=model_param(args, "pool_routing"),
            classes=sla.parse_classes(model_param(args, "service_classes")), default_class=model_param(args, "default_service_class"),
        )

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
            arrival = time.monotonic()
            serving = self._serve(arrays, request.get_response_sender(), arrival)
            with self._lock:
                worker_free = self._handed < self.max_in_flight
                self._handed += 1
            try:
                if worker_free:
                    self._first_hop(serving, arrival)
            finally:
                self.workers.submit(self._run_out, serving, None if worker_free else arrival)

    def _first_hop(self, serving: Iterator[object], arrival: float) -> None:
        """Runs a request up to its first hop's send, which the metric times from its arrival."""
        if next(serving, None) is SENT:
            self.first_hop.observe(time.monotonic() - arrival)

    def _run_out(self, serving: Iterator[object], arrival: float | None) -> None:
        """A request's worker: serves what `_accept` left of it (all of it, with its `arrival`)."""
        try:
            if arrival is not None:
                self._first_hop(serving, arrival)
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
        return ClientStream(self.out, sender, streaming, stream_id, self.coalesce_backlog)

    def _cancel_flag(self, request_id: str) -> cancel_board.CancelFlag | cancel_board.NoFlag:
        """Where postprocessing tells of a client's cancellation (through an ensemble it alone hears of it)."""
        return cancel_board.CancelFlag(self.board_key, self.instance, request_id)

    def _serve(self, arrays: dict[str, np.ndarray], sender, arrival: float) -> Iterator[object]:
        """Serves one request; yields SENT when a hop of it is on its way (never, when it ends before one), so
        that `_accept` can run it up to its first hop's send and a worker the rest."""
        request_id = f"{self._id_prefix}{next(self._ids):016x}"
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
                klass = self.router.service_class(service_class)  # checked on every path
                if self.router.pool_routing != "service_class":
                    klass = None  # checked, not routed by: a baseline
                if self.mode == "aggregated":
                    if klass is not None:
                        engine, at = self.router.admit(klass, lambda: self.router.pick_for(self.engines, klass, ("prefill", "decode")))
                    else:
                        engine, at = self.router.pick(self.engines), None
                    reached.engines.append(engine)
                    try:
                        yield from self._context_and_generation(engine, inputs, request_id, client, cancelled, arrival, measured_at=at)
                    finally:
                        self.router.done(engine)
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
        self.router.check_live(self.decoders)  # no prefill work (and KV to hand off) for a request no decode can take
        if klass is None:
            prefill, at_prefill = self.router.pick_prefill(inputs["input_ids"].reshape(-1)[: int(inputs["input_lengths"].reshape(-1)[0])]), 0
        else:
            self.router.admit(klass, lambda: self.router.choose(self.decoders, klass, ("decode",)))  # refused now if no decode pool meets it
            prefill, at_prefill = self.router.admit(klass, lambda: self.router.pick_for(self.prefills, klass, ("prefill",)))
        reached.engines.append(prefill)
        started = time.monotonic()
        try:
            if int(inputs["request_output_len"].reshape(-1)[0]) <= 1:  # the context phase is all of it
                yield from self._context_and_generation(prefill, inputs, request_id, client, cancelled, arrival)
                return

            def first_out(first: list[int]) -> None:  # on the prefill stream's reader thread
                client.emit(first)
                self.ttft.observe(time.monotonic() - arrival)

            try:
                with self._hop(prefill, inputs, request_id, "context_only", on_first_token=first_out) as hop:
                    yield SENT
                    context = list(hop.results(self.prefill_timeout_s, cancelled))
                self.router.observe("prefill", prefill, at_prefill, time.monotonic() - started)
            except HopError as exc:
                if CONTEXT_PARAMS_MISSING not in str(exc):
                    raise
                # The first token ended the request (end_id): a context-only request has no params then, and
                # the backend answers with this error. Ask for that one token as a whole request instead.
                one = {**inputs, "request_output_len": _scalar(1, np.int32)}
                yield from self._context_and_generation(prefill, one, request_id, client, cancelled, arrival)
                return
        finally:
            self.router.done(prefill)
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
                decode, at_decode = self.router.pick_for(self.decoders, klass, ("decode",))
        decode = decode or self.router.pick_decode()
        reached.engines.append(decode)
        # A generation-only request returns the context phase's token again (TensorRT-LLM re-adds it; the
        # reference engine does the same): the client already has it.
        first_at, tokens, skip = None, 0, 1

        def take(ids: list[int]) -> None:
            nonlocal first_at, tokens, skip
            reached.handoff = None  # decode answers once it has the KV
            new, skip = ids[skip:], max(0, skip - len(ids))
            client.emit(new)
            if new:
                first_at = first_at or time.monotonic()
                tokens += len(new)
                self.router.probe_tpot(decode, at_decode, first_at, tokens - len(new), tokens)

        try:
            with self._hop(decode, {**inputs, "context_phase_params": params.reshape(1, -1)}, request_id, "generation_only",
                           on_tokens=take) as hop:
                hop.wait(self.decode_timeout_s, cancelled)
            self.router.probe_tpot(decode, at_decode, first_at, tokens, tokens, ended=True)
        finally:
            self.router.done(decode)

    def _context_and_generation(self, engine: Engine, inputs: dict[str, np.ndarray], request_id: str, client: ClientStream, cancelled,
                                arrival: float, measured_at: int | None = None) -> Iterator[object]:
        """The whole request on one engine, streamed: the aggregated path, and a one-token disaggregated one.
        With `measured_at` (the requests in flight there when it was routed by class) its TTFT and TPOT
        are what the engine's pool is measured by."""
        started, first_at, count = time.monotonic(), None, 0

        def take(tokens: list[int]) -> None:
            nonlocal first_at, count
            if first_at is None and tokens:
                first_at = time.monotonic()
                self.ttft.observe(first_at - arrival)
                if measured_at is not None:
                    self.router.observe("prefill", engine, measured_at, first_at - started)
            client.emit(tokens)
            count += len(tokens)
            self.router.probe_tpot(engine, measured_at, first_at, count - len(tokens), count)

        with self._hop(engine, inputs, request_id, "context_and_generation", on_tokens=take) as hop:
            yield SENT
            hop.wait(self.decode_timeout_s, cancelled)
        self.router.probe_tpot(engine, measured_at, first_at, count, count, ended=True)

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
                decode = self.router.pick(self.decoders)
                with self._hop(decode, take, f"{request_id}-drain", "generation_only") as hop:
                    list(hop.results(STOP_TIMEOUT_S, lambda: False))
                return
            except HopError as exc:  # decode is being reloaded or restarted: wait for it
                if not exc.engine_away or time.monotonic() > deadline:
                    raise
                time.sleep(0.25)
            finally:
                if decode is not None:
                    self.router.done(decode)

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
            self.router.stopped(engine)

    @contextlib.contextmanager
    def _hop(self, engine: Engine, inputs: dict[str, np.ndarray], request_id: str, request_type: str, own_stream: bool = False,
             on_first_token: Callable[[list[int]], None] | None = None, on_tokens: Callable[[list[int]], None] | None = None):
        pids = {} if engine.replica else self.router.check_live([engine.model])
        server = self.router.server(engine.url)
        stream = server.open() if own_stream else server.shared(engine.model)
        hop = Hop(stream, engine, inputs, request_id, request_type, self.internal_key, self.liveness, pids, own_stream,
                  on_first_token, on_tokens)
        try:
            yield hop
        except BaseException:
            hop.leave()  # before the client's final answer: no token after it
            self.closer.submit(hop.end, STOP_TIMEOUT_S)  # the engine may never finish the request (timeout, hung engine)
            raise
        hop.leave()
        hop.close()

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
        self.router.close()
