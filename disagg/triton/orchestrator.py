"""The decoupled BLS orchestrator: prefill -> decode per request, streamed, many requests per instance.

Where the upstream disaggregated BLS blocks on one request at a time and throws the context phase's
token away, this one:
- serves each request on its own worker thread (`execute` returns at once), up to `max_in_flight`;
- streams the context phase's first token the moment prefill returns it (TTFT = prefill), and asks
  decode only for the tokens after it, so nothing is duplicated;
- sends decode to the least loaded decode model (fewest sequences in flight, then most free KV
  blocks, as the engines publish on the load board);
- gives each hop a deadline (`prefill_timeout_s`, `decode_timeout_s`: longest wait for the next
  response) with an error that names the hop;
- on client cancellation, a hop error or a timeout, sends `stop` for the request id to the engines,
  which frees its KV wherever it is: running, queued, or held for the handoff.
Mode "aggregated" sends the request to one engine as context_and_generation through the same path,
so the baseline pays the same front-end costs.

Every response carries the tokens produced since the last one, preceded by up to `PREFIX_TOKENS`
earlier tokens (`prefix_length` says how many), so postprocessing can finish a UTF-8 character that
straddles two responses without keeping state.
"""
from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton import load_board
from disagg.triton.contract import FORWARDED_INPUTS, OUTPUTS_READ
from disagg.triton.metrics import STUB_LOCK, TTFT_BUCKETS, Metrics
from disagg.triton.paths import model_param, repository_root

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREFIX_TOKENS = 4
_DONE = object()
_EMPTY = object()
CANCEL_CHECK_S = 0.05


class HopError(RuntimeError):
    pass


class Cancelled(Exception):
    pass


def _scalar(value, dtype) -> np.ndarray:
    return np.asarray([[value]], dtype=dtype)


class Hop:
    """One BLS call to an engine on its own thread, results handed over through a queue so the caller
    can time out and notice cancellation while the engine works.

    Every Triton object of the call (input tensors, the request, its responses) is created, read and
    released on the hop's thread; only plain numpy data crosses threads. Handing pb_utils responses from
    one thread to another corrupted the stub's heap under concurrent streams (Triton 2.51)."""

    def __init__(self, model: str, inputs: dict[str, np.ndarray], request_id: str, request_type: str):
        self.model = model
        self.results_queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, args=(inputs, request_id, request_type), name=f"hop-{model}", daemon=True).start()

    def _run(self, inputs: dict[str, np.ndarray], request_id: str, request_type: str) -> None:
        try:
            with STUB_LOCK:
                request = pb_utils.InferenceRequest(
                    model_name=self.model,
                    inputs=[pb_utils.Tensor(name, array) for name, array in inputs.items()],
                    request_id=request_id,
                    requested_output_names=list(OUTPUTS_READ),
                    parameters={"request_type": request_type},
                )
                responses = iter(request.exec(decoupled=True))
            while True:
                try:
                    response = next(responses)  # blocks until the engine answers: outside the lock
                except StopIteration:
                    break
                with STUB_LOCK:
                    self.results_queue.put(self._read(response))
                    del response
            with STUB_LOCK:
                del responses, request
        except Exception as exc:  # noqa: BLE001 - surfaced to the waiting request thread
            self.results_queue.put(HopError(f"{self.model}: {exc}"))
        self.results_queue.put(_DONE)

    @staticmethod
    def _read(response):
        """(tokens, context_phase_params or None), _EMPTY for an empty final response, or a HopError."""
        if response.has_error():
            return HopError(response.error().message())
        ids = pb_utils.get_output_tensor_by_name(response, "output_ids")
        params = pb_utils.get_output_tensor_by_name(response, "context_phase_params")
        if ids is None and params is None:
            return _EMPTY
        tokens = [] if ids is None else ids.as_numpy().reshape(-1).tolist()
        return tokens, (None if params is None else params.as_numpy().copy())

    def results(self, timeout_s: float, cancelled):
        """Yields (output_ids, context_phase_params) per non-empty response; checks cancellation every 50 ms."""
        deadline = time.monotonic() + timeout_s
        next_check = time.monotonic() + CANCEL_CHECK_S
        while True:
            try:
                item = self.results_queue.get(timeout=CANCEL_CHECK_S)
            except queue.Empty:
                item = None
            now = time.monotonic()
            if now >= next_check:  # asking is an IPC round trip: at most every CANCEL_CHECK_S, tokens or not
                next_check = now + CANCEL_CHECK_S
                with STUB_LOCK:
                    is_cancelled = cancelled()
                if is_cancelled:
                    raise Cancelled()
            if item is None:
                if now > deadline:
                    raise HopError(f"{self.model}: no response within {timeout_s:g} s")
                continue
            if item is _DONE:
                return
            if isinstance(item, Exception):
                raise item
            deadline = now + timeout_s
            if item is not _EMPTY:
                yield item


class ClientStream:
    """What the client gets: token responses (streamed, or one at the end) with a UTF-8 prefix."""

    def __init__(self, sender, streaming: bool):
        self.sender = sender
        self.streaming = streaming
        self.tokens: list[int] = []
        self.sent = 0

    def emit(self, tokens: list[int]) -> None:
        self.tokens += tokens
        if self.streaming and tokens:
            self._send(self.sent, flags=0)

    def _send(self, start: int, flags: int) -> None:
        prefix = max(0, start - PREFIX_TOKENS)
        ids = self.tokens[prefix:]
        with STUB_LOCK:
            outputs = [
                pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)),
                pb_utils.Tensor("sequence_length", np.asarray([[len(ids)]], dtype=np.int32)),
                pb_utils.Tensor("prefix_length", np.asarray([[start - prefix]], dtype=np.int32)),
            ]
            self.sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=flags)
        self.sent = len(self.tokens)

    def finish(self) -> None:
        if self.streaming:
            with STUB_LOCK:
                self.sender.send(flags=FINAL)
        else:
            self._send(0, flags=FINAL)  # the whole answer in one response, even when it is empty

    def fail(self, message: str) -> None:
        with STUB_LOCK:
            self.sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(f"model {config['name']!r} must be decoupled")
        self.mode = model_param(args, "mode")
        if self.mode == "aggregated":
            self.engines = [model_param(args, "aggregated_model_name")]
            self.decoders = []
        else:
            self.decoders = model_param(args, "generation_model_name").split(",")
            self.engines = [model_param(args, "context_model_name"), *self.decoders]
        self.board_key = load_board.board_key(repository_root(args))
        self.dispatched: dict[str, int] = {}
        self.prefill_timeout_s = float(model_param(args, "prefill_timeout_s"))
        self.decode_timeout_s = float(model_param(args, "decode_timeout_s"))
        self.workers = ThreadPoolExecutor(max_workers=int(model_param(args, "max_in_flight")), thread_name_prefix="request")
        self.metrics = Metrics(f"orchestrator-{self.mode}", args["model_instance_name"])
        self.ttft = self.metrics.histogram("disagg_ttft_seconds", "Request arrival at the orchestrator -> first token sent", TTFT_BUCKETS)
        self.in_flight = self.metrics.gauge("disagg_orchestrator_in_flight", "Requests the orchestrator is serving")
        self.failures = self.metrics.counter("disagg_orchestrator_failures_total", "Requests ended by an error or timeout")
        self.cancels = self.metrics.counter("disagg_orchestrator_cancelled_total", "Requests cancelled by the client")
        self._count = 0
        self._lock = threading.Lock()

    def execute(self, requests):
        with STUB_LOCK:
            self._accept(requests)
        return None

    def _accept(self, requests) -> None:
        for request in requests:
            # Inputs are copied here: a request's tensors are released once execute returns.
            tensors = {n: pb_utils.get_input_tensor_by_name(request, n) for n in (*FORWARDED_INPUTS, "streaming")}
            arrays = {n: t.as_numpy().copy() for n, t in tensors.items() if t is not None}
            del tensors
            self.workers.submit(self._serve, arrays, request.get_response_sender(), time.monotonic())

    def _serve(self, arrays: dict[str, np.ndarray], sender, arrival: float) -> None:
        self._track(+1)
        request_id = uuid.uuid4().hex
        streaming = arrays.pop("streaming", None)
        client = ClientStream(sender, bool(streaming is not None and streaming.reshape(-1)[0]))
        inputs = {**arrays, "streaming": _scalar(True, np.bool_)}
        try:
            if self.mode == "aggregated":
                hop = Hop(self.engines[0], inputs, request_id, "context_and_generation")
                for n, (tokens, _) in enumerate(hop.results(self.decode_timeout_s, sender.is_cancelled)):
                    if n == 0:
                        self.ttft.observe(time.monotonic() - arrival)
                    client.emit(tokens)
            else:
                self._disaggregated(request_id, inputs, client, sender, arrival)
            client.finish()
        except Cancelled:
            self.cancels.increment(1)
            self._stop_everywhere(request_id)
            self._quietly(client.finish)
        except HopError as exc:
            self.failures.increment(1)
            self._stop_everywhere(request_id)
            self._quietly(lambda: client.fail(str(exc)))
        finally:
            self._track(-1)

    def _disaggregated(self, request_id: str, inputs: dict[str, np.ndarray], client: ClientStream, sender, arrival: float) -> None:
        prefill = self.engines[0]
        context = list(Hop(prefill, inputs, request_id, "context_only").results(self.prefill_timeout_s, sender.is_cancelled))
        if not context:  # the first token was end_id: the request is complete and empty
            return
        tokens, params = context[-1]
        client.emit(tokens)
        self.ttft.observe(time.monotonic() - arrival)
        if params is None:  # finished in the context phase (end_id or max_tokens=1): no KV was kept
            return
        if sender.is_cancelled():
            raise Cancelled()
        with self._lock:
            decode = load_board.least_loaded(self.board_key, self.decoders, self.dispatched)
            self.dispatched[decode] = self.dispatched.get(decode, 0) + 1
        try:
            hop = Hop(decode, {**inputs, "context_phase_params": params.reshape(1, -1)}, request_id, "generation_only")
            for tokens, _ in hop.results(self.decode_timeout_s, sender.is_cancelled):
                client.emit(tokens)
        finally:
            with self._lock:
                self.dispatched[decode] -= 1

    def _stop_everywhere(self, request_id: str) -> None:
        """Frees the request's KV in every engine it may have touched (a no-op where it is gone)."""
        stop = {
            "input_lengths": _scalar(0, np.int32),
            "request_output_len": _scalar(1, np.int32),
            "stop": _scalar(True, np.bool_),
        }
        for model in self.engines:
            self._quietly(lambda m=model: list(Hop(m, stop, request_id, "context_and_generation").results(5.0, lambda: False)))

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
        self.workers.shutdown(wait=False, cancel_futures=True)
