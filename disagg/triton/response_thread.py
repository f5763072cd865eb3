"""Sends a Python model's client responses without its request threads queueing for the stub's lock.

Calls into Triton 2.51's stub are serialised (STUB_LOCK, disagg.triton.metrics). With each request's worker
sending its own responses, 64 streams were 64 threads queueing for that lock, each hand-over a thread
wake-up: a py-spy profile of tensorrt_llm_bls at 64 streams found 15% of its GIL time on the line that takes
the lock to send. Here a response goes out at once, on the thread that gives it (an engine stream's reader,
a request's worker), when the lock is free and its stream has none queued (one stream: no hand-over to
another thread, which cost its first token a thread wake-up); otherwise it is queued, and one thread sends all those waiting under one hold of the lock. A stream's
responses keep their order: one queued behind another of its stream is sent after it, and none is sent at
once while one of its stream is queued. A response's tensors are made and held until Triton has sent it
(disagg.triton.responses).
"""
from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton import responses
from disagg.triton.metrics import STUB_LOCK

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class ResponseThread:
    """Sends the responses given to `send` and `fail`, until `close`. Each sender's responses come from one
    thread of the caller's at a time, in order (the engine streams' reader threads with the tokens, one hop
    after the other, then its request's worker with the end)."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: dict[int, int] = {}  # id(sender) -> its responses queued and not yet sent
        self._count_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="client-responses", daemon=True)
        self._thread.start()

    def send(self, sender, outputs: dict[str, np.ndarray], flags: int = 0, then: Callable[[], None] | None = None) -> None:
        """A response of `outputs` (name -> array); `then` is called once it has been sent (or failed to,
        or, after `close`, dropped: a request cut short by the model's unloading waits for nothing)."""
        self._put((sender, outputs, flags, then))

    def fail(self, sender, message: str) -> None:
        """A final error response."""
        self._put((sender, message, FINAL, None))

    def close(self) -> None:
        """Sends what is queued, then ends the thread."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _put(self, item: tuple) -> None:
        sender, then = item[0], item[3]
        if self._closed:
            if then is not None:
                then()
            return
        with self._count_lock:
            queued = self._queued.get(id(sender), 0)
        if not queued and STUB_LOCK.acquire(blocking=False):
            try:
                self._send(*item[:3])
            finally:
                STUB_LOCK.release()
            if then is not None:
                then()
            return
        with self._count_lock:
            self._queued[id(sender)] = self._queued.get(id(sender), 0) + 1
        self._queue.put(item)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while not self._queue.empty() and (item := self._queue.get()) is not None:
                batch.append(item)
            with STUB_LOCK:
                for sender, outputs, flags, _ in batch:
                    self._send(sender, outputs, flags)
            with self._count_lock:
                for sender, *_ in batch:
                    left = self._queued.pop(id(sender)) - 1
                    if left:
                        self._queued[id(sender)] = left
            for *_, then in batch:
                if then is not None:
                    self._quietly(then)
            if item is None:
                return

    def _quietly(self, then: Callable[[], None]) -> None:
        """A sent response's `then` (a stream giving its next response): a fault there must not end this thread,
        which sends every stream's queued responses."""
        try:
            then()
        except Exception:  # noqa: BLE001 - logged; the other streams go on
            pb_utils.Logger.log_error(f"{self.name}: after a response was sent: {traceback.format_exc()}")

    def _send(self, sender, outputs: dict[str, np.ndarray] | str, flags: int) -> None:
        try:
            if isinstance(outputs, str):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(outputs)), flags=flags)
            else:
                responses.send(sender, [pb_utils.Tensor(name, array) for name, array in outputs.items()], flags)
        except Exception:  # noqa: BLE001 - one client's failed send must not stop every other client's responses
            pb_utils.Logger.log_error(f"{self.name}: a response was not sent: {traceback.format_exc()}")
