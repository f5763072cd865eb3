"""What the end-to-end tests read off a running deployment: KV blocks, cancellations, background load."""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
from safetensors.numpy import load_file

from disagg.engine.sampling import NO_END_ID
from disagg.serve.metrics import by_role, scrape
from tools.stream_client import stream


def never_token(project) -> int:
    """A token whose LM-head row is silenced in the generated model: as end_id, the stream runs its length."""
    head = load_file(str(project / "build/checkpoints/tiny-llama/model.safetensors"))["lm_head.weight"]
    return int(np.flatnonzero(~head.any(axis=1))[0])


def wait_kv_zero(server, timeout_s: float = 5.0) -> dict[str, float]:
    """KV blocks in use per role once the pool has drained and no request is left in an engine."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = by_role(scrape(server.metrics_url))
        used, busy = metrics["disagg_kv_blocks_in_use"], metrics["disagg_requests_in_flight"]
        if not any(used.values()) and not any(busy.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.1)


def cancelled_total(server, role: str) -> float:
    return by_role(scrape(server.metrics_url))["disagg_orchestrator_cancelled_total"][role]


def cancels_after(server, role: str, before: float, timeout_s: float = 5.0) -> float:
    """The orchestrator's cancellation count once it has moved past `before`, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while (count := cancelled_total(server, role)) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    return count


@contextlib.contextmanager
def busy(server, model: str, streams: int = 8):
    """Long requests alongside a test, so the request it cancels is still generating when the cancellation
    is seen. Through an ensemble that is at the stream's next postprocessing call, and a lone tiny-model
    engine can produce all 300 tokens before postprocessing gets there. These requests are not streamed:
    they slow the engine's steps without queueing work for postprocessing."""
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            stream(server.grpc_url, model, f"background {i}", 300, streaming=False, end_id=NO_END_ID)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        for t in threads:
            t.join(120)
    assert not errors, errors
