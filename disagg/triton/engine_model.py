"""The reference engine as a decoupled Triton Python model, in the slot of the tensorrtllm backend.

One instance = one `LLMEngine` on its own loop thread. `execute` only parses and queues: every
request is answered through its response sender as the engine produces tokens, so many requests
are in flight per instance (in-flight batching). Responses are the tensorrtllm backend's: streaming,
one per engine step that returned tokens, carrying those tokens (a generation-only request's first
response carries the context phase's token and the next one), the last one final; otherwise one final
response with them all. A context-only request gets one final response with its first token and
`context_phase_params`, or an error when that token already ended it. The request parameter `request_type` picks the phase; a request with
`stop=true` and the id of a request in flight on this instance cancels it and frees its KV. A prefill
instance keeps its KV pool in shared memory and runs a transfer agent; a decode instance claims the
handed-off KV through a `KVPuller` and copies it straight into the blocks it reserved.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils
from threadpoolctl import threadpool_info, threadpool_limits

from disagg.engine.engine import ContextPhase, LLMEngine, Request, RequestError, StepOutput
from disagg.engine.kv_store import KVStore
from disagg.engine.loop import EngineLoop
from disagg.engine.no_compute import SKIP_COMPUTE_ENV, skip_compute
from disagg.triton import credential, kv_index, load_board, responses
from disagg.triton.cancel_board import Throttle
from disagg.triton.contract import CONTEXT_PARAMS_MISSING
from disagg.triton.metrics import BackendMetrics, EngineMetrics
from disagg.triton.paths import model_param, repository_root, resolve_path
from disagg.triton.tensors import EngineCall, parse_engine_call
from disagg.transfer.agent import TransferAgent
from disagg.transfer.params import ContextParamsError, ContextPhaseParams
from disagg.transfer.puller import KVPuller
from disagg.transfer.shm import SharedPool, pool_name, unlink_predecessors

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCEL_CHECK_S = 0.02  # as the tensorrtllm configs' cancellation_check_period_ms


def _tensor(name: str, array: np.ndarray):
    return pb_utils.Tensor(name, array)


def _ids(tokens):
    return [
        _tensor("output_ids", np.asarray(tokens, dtype=np.int32).reshape(1, 1, -1)),
        _tensor("sequence_length", np.asarray([[len(tokens)]], dtype=np.int32)),
    ]


class Stream:
    """One request's response sender: thread-safe, closed exactly once, streaming or accumulating."""

    def __init__(self, sender, call: EngineCall):
        self.sender = sender
        self.call = call
        self.tokens: list[int] = []
        self.arrival_ns = time.time_ns()
        self.first_token_ns = 0
        self.closed = False
        self._cancelled = False
        self._check = Throttle(CANCEL_CHECK_S)
        self._lock = threading.Lock()

    def cancelled(self) -> bool:
        """True once the client has cancelled or the stream is closed. Asks Triton at most every
        CANCEL_CHECK_S (an IPC round trip, on the path of every token's response), and never once
        the final response is out: the sender's factory is freed then, and asking crashed the server
        (Signal 11 in TRITONBACKEND_ResponseFactoryIsCancelled) when a `stop` closed a stream while
        a response thread was checking it."""
        with self._lock:
            if self.closed or self._cancelled:
                return True
            if self._check.due():
                self._cancelled = self.sender.is_cancelled()
            return self._cancelled

    def respond(self, tokens: tuple[int, ...], final: bool, extra: list | None = None) -> None:
        """One engine result, as the tensorrtllm backend turns an executor response into a Triton one
        (model_instance_state.cc fillTritonResponse): streaming, output_ids holds the tokens new since the
        last response (none for a final one after end_id) and nothing is sent for a step without any;
        otherwise only the final response is sent, with every token."""
        with self._lock:
            if self.closed:
                return
            if tokens:
                self.first_token_ns = self.first_token_ns or time.time_ns()
            self.tokens += tokens
            if not final:
                if self.call.streaming and tokens:
                    responses.send(self.sender, _ids(tokens))
                return
            self.closed = True
            outputs = _ids(tokens if self.call.streaming else self.tokens) + list(extra or [])
            if self.call.return_perf_metrics:
                now = time.time_ns()
                for name, value in (("arrival_time_ns", self.arrival_ns), ("first_token_time_ns", self.first_token_ns), ("last_token_time_ns", now)):
                    outputs.append(_tensor(name, np.asarray([[value]], dtype=np.int64)))
            responses.send(self.sender, outputs, FINAL)

    def fail(self, message: str) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        # One BLAS thread per engine instance. OpenBLAS workers spin after every call: on a small machine
        # they starved the server threads that forward this model's responses, and about one streamed
        # answer in twenty reached the client all at once, at its end. The tiny per-step matmuls gain
        # nothing from more threads.
        self._blas = threadpool_limits(1, user_api="blas")
        blas = ", ".join(f"{p['internal_api']} {p['num_threads']}" for p in threadpool_info() if p["user_api"] == "blas")
        pb_utils.Logger.log_info(f"{args['model_instance_name']}: BLAS threads: {blas or 'none loaded'}")
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"model {config['name']!r} must be decoupled (model_transaction_policy)")
        self.name = config["name"]
        self.role = model_param(args, "role")
        self.transport = model_param(args, "kv_transfer_backend")
        self.instance = args["model_instance_name"]
        self.board_key = load_board.board_key(repository_root(args))
        other = load_board.served_elsewhere(self.board_key, self.name, self.instance)
        if other is not None:
            raise pb_utils.TritonModelException(
                f"{self.instance}: tritonserver pid {other} already serves this model repository with the same load board "
                f"({load_board.board_dir()}): the two would read and overwrite each other's load and KV pools. Give this "
                f"server a board of its own: {load_board.BOARD_ENV}=<a directory of its own>")
        self.internal_key = credential.internal_key(self.board_key)
        self.pool = None
        if self.role == "prefill" and self.transport == "shm":
            # Named by deployment, instance and process: a restarted instance removes its killed predecessor's
            # pool, and a server's start and stop sweep whatever a crash left (disagg.serve.leftovers).
            lineage = f"disagg_{self.board_key}_{self.instance}"
            unlink_predecessors(lineage)
            self.pool = SharedPool(pool_name(lineage))
        self.metrics = EngineMetrics(self.role, self.instance)
        # The backend's gauges are the model's (every instance summed), so one instance publishes them: two
        # stubs' series of the same labels free one Prometheus series twice as the model unloads (BackendMetrics).
        first = self.instance == f"{self.name}_0_0"
        self.backend_metrics = BackendMetrics(self.name, str(args["model_version"])) if first else None
        self.metrics.restarts.set(load_board.restarts(self.board_key).get(self.name, 0))
        if skip_compute():
            pb_utils.Logger.log_warn(f"{self.instance}: {SKIP_COMPUTE_ENV}=1: the forward pass is skipped, tokens are not the model's")
        store_bytes = int(model_param(args, "kv_store_bytes"))
        store = None
        if store_bytes:  # shared by the deployment's instances on this node
            disk_bytes = int(model_param(args, "kv_store_disk_bytes"))
            disk = (repository_root(args) / model_param(args, "kv_store_disk_dir")).resolve() if disk_bytes else None
            below = KVStore(disk, "", disk_bytes) if disk else None
            store = KVStore(load_board.board_dir(), f"disagg-kvstore-{self.board_key}-", store_bytes, below)
        engine = LLMEngine(resolve_path(args, "engine_dir"), kv_buffer=self.pool.allocate if self.pool else None,
                           skip_compute=skip_compute(), kv_store=store)
        self.loop = EngineLoop(engine)
        self.agent = None
        if self.role == "prefill":
            self.agent = TransferAgent(
                self.loop,
                transport=self.transport,
                shm_name=self.pool.name if self.pool else "",
                bind=model_param(args, "kv_bind_address"),
                lease_s=float(model_param(args, "kv_lease_seconds")),
            )
        self.puller = KVPuller()
        self.pulls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-pull")
        self.streams: dict[str, Stream] = {}
        self._pulling = 0  # generation requests claiming their KV, not yet in the engine: load all the same
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # On the board before Triton calls the model ready: a watchdog that finds a restarted server ready
        # must not see a killed predecessor's pid under this instance's name and reload the new instance.
        self._publish_load(self.loop.stats())
        self._refresher = threading.Thread(target=self._refresh_metrics, name="metrics", daemon=True)
        self._refresher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if not credential.presented(json.loads(request.parameters() or "{}"), self.internal_key):
                error = pb_utils.TritonError(
                    f"{self.name}: engine models serve this deployment's orchestrators only: the request parameter "
                    f"{credential.PARAMETER} is missing or wrong (send text to the ensemble, or see disagg.triton.credential)")
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            try:
                call = parse_engine_call(request, pb_utils)
            except RequestError as exc:
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))), flags=FINAL)
                continue
            if call.stop:
                self._stop(call.request_id, sender)
            elif call.request_type == "generation_only":
                with self._lock:
                    self._pulling += 1
                self.pulls.submit(self._pull, call, Stream(sender, call))
            else:
                self._start(self._request(call, None), Stream(sender, call))
        return None

    # -- request lifecycle -------------------------------------------------------------------------
    @staticmethod
    def _request(call: EngineCall, context: ContextPhase | None) -> Request:
        req_id = call.request_id or uuid.uuid4().hex
        return Request(req_id, call.input_ids, call.max_new_tokens, call.request_type, call.sampling, call.end_id, context)

    def _start(self, request: Request, stream: Stream) -> None:
        with self._lock:
            self.streams[request.req_id] = stream
        try:
            self.loop.submit(request, lambda out: self._on_output(request.req_id, stream, out))
        except (RequestError, ValueError) as exc:
            self._forget(request.req_id)
            stream.fail(str(exc))

    def _pull(self, call: EngineCall, stream: Stream) -> None:
        try:
            self._pull_and_submit(call, stream)
        finally:
            with self._lock:
                self._pulling -= 1

    def _pull_and_submit(self, call: EngineCall, stream: Stream) -> None:
        """The handoff on a pull thread: claim prefill's blocks, reserve ours, copy straight across, ack.
        When this engine has no room right now the KV is copied out instead and the request waits, so
        prefill's blocks are freed without waiting for decode to have room."""
        if call.context_phase_params is None:
            stream.fail("context_phase_params: required for a generation_only request")
            return
        try:
            params = ContextPhaseParams.from_bytes(call.context_phase_params)
            if params.prompt_len != len(call.input_ids):
                raise ContextParamsError(f"context_phase_params: describes a {params.prompt_len}-token prompt, input_ids has {len(call.input_ids)}")
            claim = self.puller.claim(params)
        except ContextParamsError as exc:
            stream.fail(str(exc))
            return
        request = self._request(call, ContextPhase(params.first_token, claim.kv))
        with self._lock:
            self.streams[request.req_id] = stream
        blocks = None
        try:
            try:
                blocks = self.loop.begin_import(request, lambda out: self._on_output(request.req_id, stream, out))
                if blocks is not None:
                    claim.kv.copy_into(self.loop.engine.kv, self.loop.engine.layout, blocks)
                else:
                    request = dataclasses.replace(request, context=ContextPhase(params.first_token, claim.contiguous()))
            finally:
                seconds = self.puller.ack(claim)  # prefill's blocks are freed whatever happened here
        except (RequestError, ContextParamsError, ValueError) as exc:
            if blocks is not None:
                self.loop.finish_import(request.req_id, copied=False)
            self._forget(request.req_id)
            stream.fail(str(exc))
            return
        self.metrics.handoff_bytes.increment(claim.kv.nbytes)
        self.metrics.handoff_seconds.increment(seconds)
        self.metrics.handoff_count.increment(1)
        if blocks is not None:
            if not self.loop.finish_import(request.req_id, copied=not stream.cancelled()):
                self._forget(request.req_id)
                stream.respond((), final=True)
        elif stream.cancelled():
            self._forget(request.req_id)
            stream.respond((), final=True)
        else:
            self._start(request, stream)

    def _on_output(self, req_id: str, stream: Stream, out: StepOutput) -> None:
        if stream.cancelled():  # by the client, or closed by a `stop` (possibly while its KV was pulled)
            raise RuntimeError("cancelled")  # the loop aborts the request and frees its KV
        if out.error:
            self._forget(req_id)
            stream.fail(out.error)
            return
        if out.finished:
            self._forget(req_id)
        extra = None
        if out.finish_reason == "context_done":
            params = self.agent.hold(out)
            extra = [_tensor("context_phase_params", np.frombuffer(params.to_bytes(), dtype=np.uint8).reshape(1, -1))]
        elif out.finished and stream.call.request_type == "context_only":
            # Finished in its context phase (end_id, or request_output_len 1): no params. The KV is freed.
            stream.fail(f"Error encountered while populating response: {CONTEXT_PARAMS_MISSING}")
            return
        if out.finished and stream.call.return_perf_metrics and out.kv_blocks:
            # the executor's per-request KV cache metrics, as TB fillTritonResponse outputs them
            total, reused = out.kv_blocks
            extra = (extra or []) + [_tensor(name, np.asarray([[value]], dtype=np.int32)) for name, value in (
                ("kv_cache_alloc_new_blocks", total - reused), ("kv_cache_reused_blocks", reused), ("kv_cache_alloc_total_blocks", total))]
        stream.respond(out.tokens, out.finished, extra)

    def _stop(self, req_id: str, sender) -> None:
        """A `stop` request, answered as model_instance_state.cc handleStopRequest does: an error when it names
        no request, else one empty final response, whether or not `req_id` is in flight here (it may be done
        already, or on another instance; nothing else is touched). A request whose stream is still open
        here is cancelled: its KV is freed and its stream ends with a final response (the executor finishes
        a cancelled request like any other). One whose final response is out is no longer known: the
        backend drops a request's id when it sends that response, so a context-only request that answered
        keeps its KV for the handoff until a generation request takes it (here: or its lease runs out)."""
        if not req_id:
            error = pb_utils.TritonError("Trying to stop a request but request ID is not provided")
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        stream = self._forget(req_id)
        if stream is not None:
            self.loop.abort(req_id)
            stream.respond((), final=True)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _forget(self, req_id: str) -> Stream | None:
        with self._lock:
            return self.streams.pop(req_id, None)

    def _refresh_metrics(self, period_s: float = 0.1) -> None:
        """Gauges and the load board follow the pool whatever changed it: a step, an ack, a lease expiry, a cancel."""
        reclaimed, index_version = 0, -1  # -1: publish at once, replacing a killed predecessor's index
        store_check = Throttle(1.0)
        reuse = self.loop.engine.blocks.reuse
        tpb = self.loop.engine.config.build.tokens_per_block
        while not self._closed.wait(period_s):
            if reuse:  # what the prefix cache holds, for cache-aware routing
                index_version, hashes = self.loop.cached_blocks(index_version)
                if hashes is not None:
                    kv_index.publish(self.board_key, self.name, self.instance, tpb, hashes)
            with self.agent.reaping if self.agent is not None else contextlib.nullcontext():
                stats, expired = self.loop.stats(), self.agent.reclaimed if self.agent is not None else 0
            if expired > reclaimed:  # counted before the gauges show the blocks free
                self.metrics.reclaimed.increment(expired - reclaimed)
                reclaimed = expired
            self.metrics.update(stats, self.agent.num_held if self.agent else 0)
            store = self.loop.engine.store
            if store is not None and store_check.due():  # a directory scan: once a second
                self.metrics.store_bytes.set(store.nbytes())
                self.metrics.store_evictions.set(store.evicted)
            self._publish_load(stats)
            load = load_board.model_load(self.board_key, self.name)  # every instance of the model, this one included
            if load is not None and self.backend_metrics is not None:
                self.backend_metrics.update(load, tpb)

    def _publish_load(self, stats) -> None:
        with self._lock:
            pulling = self._pulling
        load_board.publish(self.board_key, self.name, self.instance, stats.in_flight + stats.delivering + pulling,
                           stats.blocks_total - stats.blocks_used,
                           scheduled=stats.running, in_context=stats.in_context, active=stats.running + pulling,
                           held=stats.held, blocks_total=stats.blocks_total,
                           max_batch_size=self.loop.engine.config.build.max_batch_size)

    def finalize(self):
        self._closed.set()
        self._refresher.join(timeout=5)  # a publish already under way would recreate the entry withdrawn here
        self.metrics.release()
        if self.backend_metrics is not None:
            self.backend_metrics.release()
        load_board.withdraw(self.board_key, self.name, self.instance)
        kv_index.withdraw(self.board_key, self.name, self.instance)
        self.pulls.shutdown(wait=False, cancel_futures=True)
        if self.agent is not None:
            self.agent.close()
        self.loop.stop()
        self.puller.close()
        if self.pool is not None:
            self.pool.unlink()
