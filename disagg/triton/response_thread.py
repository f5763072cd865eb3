"""One thread that sends every client response of a Python model, in the order they were queued.

Calls into Triton 2.51's stub are serialised (STUB_LOCK, disagg.triton.metrics). With each request's worker
sending its own responses, 64 streams were 64 threads queueing for that lock, each hand-over a thread
wake-up: a py-spy profile of tensorrt_llm_bls at 64 streams found 15% of its GIL time on the line that takes
the lock to send. Here workers queue their responses and this thread sends all those waiting under one hold
of the lock. A stream's responses keep their order: one thread sends them all, in the order queued. A
response's tensors are made and held here until Triton has sent it (disagg.triton.responses).
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


class ResponseThread:
    """Sends the responses queued by `send` and `fail`, until `close`."""

    def __init__(self, name: str):
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="client-responses", daemon=True)
        self._thread.start()

    def send(self, sender, outputs: dict[str, np.ndarray], flags: int = 0, then: Callable[[], None] | None = None) -> None:
        """Queues a response of `outputs` (name -> array); `then` is called once it has been sent (or failed to,
        or, after `close`, dropped: a request cut short by the model's unloading waits for nothing)."""
        if self._thread.is_alive():
            self._queue.put((sender, outputs, flags, then))
        elif then is not None:
            then()

    def fail(self, sender, message: str) -> None:
        """Queues a final error response."""
        self._queue.put((sender, message, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL, None))

    def close(self) -> None:
        """Sends what is queued, then ends the thread."""
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            batch = [item]
            while not self._queue.empty() and (item := self._queue.get()) is not None:
                batch.append(item)
            with STUB_LOCK:
                for sender, outputs, flags, _ in batch:
                    self._send(sender, outputs, flags)
            for *_, then in batch:
                if then is not None:
                    then()
            if item is None:
                return

    def _send(self, sender, outputs: dict[str, np.ndarray] | str, flags: int) -> None:
        try:
            if isinstance(outputs, str):
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(outputs)), flags=flags)
            else:
                responses.send(sender, [pb_utils.Tensor(name, array) for name, array in outputs.items()], flags)
        except Exception:  # noqa: BLE001 - one client's failed send must not stop every other client's responses
            pb_utils.Logger.log_error(f"{self.name}: a response was not sent: {traceback.format_exc()}")
