"""Runs an `LLMEngine` on a background thread so a Triton model can submit requests and stream results.

Callers never touch the engine directly. `submit` validates and queues without the engine's lock, as
TensorRT-LLM's `enqueueRequests` only queues for its loop (executor/executorImpl.cpp: `mQueuedRequests`,
taken in by `getLeaderNewReqWithIds` at the top of an iteration): a model's `execute` that waited for the
step under way let one request in per step, and at 64 streams the prefill model's requests queued for 0.35 s
before Triton could hand it the next. The next holder of the lock takes the queued requests in first, so
whatever it reads or changes (the waiting queue, an abort, the stats) sees them. `abort`, `release` and the
KV import take the lock (a `FairLock`, so a caller waits for the step under way, not for a gap between
steps). Each request's `on_output(StepOutput)`
is called after every step, in order, by a delivery thread of its own, so the loop starts its next step
while the last one's responses go out: as the tensorrtllm backend sends responses from a thread that
awaits the executor's (model_instance_state.cc `WaitForResponse`), whose steps never wait for Triton. A
Python model's response is an IPC round trip to its server, a few per step at least; on the loop thread
those waits stretched every step wherever the server's process was short of CPU. A callback that raises
aborts its request: the KV is freed.
"""
from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from disagg.engine.engine import LLMEngine, Request, RequestError, StepOutput
from disagg.engine.fair_lock import FairLock

OnOutput = Callable[[StepOutput], None]


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot for metrics and load-based routing."""

    waiting: int
    running: int  # in the batch, or having its KV copied in
    held: int
    blocks_used: int
    blocks_total: int
    blocks_cached: int = 0  # registered for reuse (held or evictable)
    reused_blocks: int = 0  # prompt blocks found cached, since the engine started
    prompt_blocks: int = 0  # prompt blocks looked up, since the engine started
    store_hits: int = 0  # prompt blocks imported from the node's store, since the engine started
    tokens_per_block: int = 0
    in_context: int = 0  # in the batch with their prompt not yet all computed
    delivering: int = 0  # done in the engine (not held), their last response not yet sent: still the model's

    @property
    def in_flight(self) -> int:
        return self.waiting + self.running


class _Listener:
    """A request's `on_output` until the request is aborted: outputs still queued for it are then dropped."""

    __slots__ = ("on_output", "active")

    def __init__(self, on_output: OnOutput):
        self.on_output, self.active = on_output, True


class EngineLoop:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._lock = FairLock()  # the loop retakes it after every step: callers are served in turn, not starved
        self._wake = threading.Condition(self._lock)
        self._callbacks: dict[str, _Listener] = {}
        self._submitted: deque[tuple[Request, _Listener]] = deque()  # validated, not yet in the engine
        self._idle = False  # the loop waits for work: a submit must wake it
        self._deliveries: queue.SimpleQueue[list[tuple[_Listener, StepOutput]] | None] = queue.SimpleQueue()
        # requests done in the engine (not held) whose last output was queued / has been delivered or dropped;
        # the first written under the engine's lock, the second by the delivery thread alone: the difference needs
        # no lock of its own
        self._finals_queued = self._finals_delivered = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._delivery = threading.Thread(target=self._deliver, name="engine-responses", daemon=True)
        self._thread.start()
        self._delivery.start()

    def submit(self, request: Request, on_output: OnOutput) -> None:
        """Validates and queues, without waiting for the step under way; raises RequestError (nothing queued)
        for a bad request. An id already in flight is found when the request is taken in, and answered
        through `on_output`, as TensorRT-LLM answers what it refuses in `fetchNewRequests`."""
        self.engine.validate(request)
        self._submitted.append((request, _Listener(on_output)))
        if self._idle:  # read after the append: the loop sets it before its last look at the queue
            with self._lock:
                self._wake.notify()

    @contextlib.contextmanager
    def _holding(self) -> Iterator[None]:
        """The engine's lock, the requests submitted since its last holder taken in."""
        with self._lock:
            self._take_submitted()
            yield

    def _take_submitted(self) -> None:
        refused = []
        while self._submitted:
            request, listener = self._submitted.popleft()
            try:
                self.engine.enqueue(request)
            except RequestError as exc:
                refused.append((listener, StepOutput(request.req_id, (), True, "error", str(exc))))
                continue
            self._callbacks[request.req_id] = listener
        if refused:
            self._finals_queued += len(refused)
            self._deliveries.put(refused)

    def begin_import(self, request: Request, on_output: OnOutput) -> list[int] | None:
        """`LLMEngine.begin_import`; when blocks are reserved the request is tracked like a submitted one."""
        with self._holding():
            blocks = self.engine.begin_import(request)
            if blocks is not None:
                self._callbacks[request.req_id] = _Listener(on_output)
            return blocks

    def finish_import(self, req_id: str, copied: bool) -> bool:
        with self._holding():
            running = self.engine.finish_import(req_id, copied)
            if running:
                self._wake.notify()
            else:
                self._drop(req_id)
            return running

    def abort(self, req_id: str) -> bool:
        """Cancels a request wherever it is; its callback is not called again (a call under way ends, and an
        output that finished the request before the abort is still delivered)."""
        with self._holding():
            self._drop(req_id)
            return self.engine.abort(req_id)

    def _drop(self, req_id: str) -> None:
        """Forgets a request's callback, outputs already queued for it included; the caller holds the lock."""
        listener = self._callbacks.pop(req_id, None)
        if listener is not None:
            listener.active = False

    def release(self, req_id: str) -> bool:
        with self._holding():
            return self.engine.release(req_id)

    def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """Runs fn(engine) under the engine lock (exporting KV, reading tables)."""
        with self._holding():
            return fn(self.engine)

    def stats(self) -> EngineStats:
        with self._holding():
            return self._stats()

    def _stats(self) -> EngineStats:
        e = self.engine
        return EngineStats(len(e.waiting), e.num_in_batch, len(e.held), e.blocks.num_used, e.blocks.num_blocks,
                           e.blocks.num_cached, e.reused_blocks, e.prompt_blocks, e.store_hits, e.blocks.tokens_per_block,
                           e.num_in_context, self._finals_queued - self._finals_delivered)

    def cached_blocks(self, since_version: int) -> tuple[int, np.ndarray | None]:
        """The prefix cache's version and, if it changed since `since_version`, its block hashes."""
        with self._lock:
            blocks = self.engine.blocks
            if blocks.version == since_version:
                return since_version, None
            return blocks.version, np.fromiter(blocks.by_hash, dtype=np.uint64, count=len(blocks.by_hash))

    def stop(self, timeout: float = 5.0) -> None:
        """Aborts everything in flight and joins the thread (Triton's finalize)."""
        with self._holding():
            self._stopping = True
            for req_id in list(self._callbacks):
                self._drop(req_id)
                self.engine.abort(req_id)
            self._wake.notify()
        self._thread.join(timeout)
        self._deliveries.put(None)
        self._delivery.join(timeout)

    def _step(self) -> list[StepOutput]:
        """One engine step; if it fails, every request in flight is aborted and told why."""
        try:
            return self.engine.step()
        except Exception as exc:  # noqa: BLE001 - reported to every request, then the loop goes on
            failed = list(self._callbacks)
            for req_id in failed:
                self.engine.abort(req_id)
            return [StepOutput(r, (), True, "error", f"engine step failed: {exc!r}") for r in failed]

    def _run(self) -> None:
        while True:
            with self._holding():
                while not self._stopping and not self.engine.has_work():
                    self._idle = True
                    if not self._submitted:
                        self._wake.wait()
                    self._idle = False
                    self._take_submitted()
                if self._stopping:
                    return
                outputs = self._step()
                deliveries = [(listener, o) for o in outputs if (listener := self._callbacks.get(o.req_id)) is not None]
                for o in outputs:
                    if o.finished:
                        self._callbacks.pop(o.req_id, None)  # its listener stays active for this last delivery
                self._finals_queued += sum(_ends_delivery(o) for _, o in deliveries)
            if deliveries:
                self._deliveries.put(deliveries)

    def _deliver(self) -> None:
        """Calls the listeners of each step's outputs, in step order; one that raises has its request aborted."""
        while (deliveries := self._deliveries.get()) is not None:
            for listener, output in deliveries:
                try:
                    if listener.active:
                        listener.on_output(output)
                except Exception:  # noqa: BLE001 - a broken sender must not stop other requests
                    self.abort(output.req_id)
                finally:
                    self._finals_delivered += _ends_delivery(output)


def _ends_delivery(output: StepOutput) -> bool:
    """Whether `output` is the last a request delivers while it holds nothing in the engine (a held context
    phase is counted as held)."""
    return output.finished and output.held is None
