"""A client's cancellation of an ensemble stream, carried from postprocessing to the orchestrator.

Triton 2.51 checks an ensemble request for cancellation only between steps: once a gRPC client cancels,
every later postprocessing request is marked cancelled, but the orchestrator step, already running, is
never told and would generate to the end. So each orchestrator request opens a flag on the board (the
load board's directory: memory), names it in every response (`stream_id`), and postprocessing raises it
when it sees its own request cancelled. The orchestrator polls the flag with its sender's cancellation.

Postprocessing never creates a flag file: one raised after its stream ended does nothing and leaves
nothing behind. An orchestrator instance removes its own leftovers (from a crash) when it starts.

Asking Triton whether a request is cancelled is an IPC round trip, too dear for every token: every
model paces its checks with a `Throttle`.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from disagg.triton.load_board import board_dir

_STREAM_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # no "/": a flag stays inside the board


def _path(key: str, stream_id: str) -> Path:
    if not _STREAM_ID.fullmatch(stream_id):
        raise ValueError(f"stream_id {stream_id!r} is not a stream id (letters, digits, '_', '.' and '-')")
    return board_dir() / f"disagg-cancel-{key}-{stream_id}"


class CancelFlag:
    """One orchestrator request's flag: a file that is empty until postprocessing writes to it."""

    def __init__(self, key: str, owner: str, request_id: str):
        self.stream_id = f"{owner}.{request_id}"
        self.path = _path(key, self.stream_id)
        self.path.touch(exist_ok=False)

    def is_raised(self) -> bool:
        try:
            return self.path.stat().st_size > 0
        except FileNotFoundError:
            return False

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


class NoFlag:
    """For a request no postprocessing serves (tensorrt_llm_bls): nothing can raise a flag, so none is made
    (a file made and removed per request costs about 0.15 ms of its TTFT here)."""

    stream_id = ""

    def is_raised(self) -> bool:
        return False

    def close(self) -> None:
        pass


def raise_flag(key: str, stream_id: str) -> bool:
    """Marks the stream cancelled; False when its orchestrator request has already ended."""
    try:
        fd = os.open(_path(key, stream_id), os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        os.write(fd, b"1")
    finally:
        os.close(fd)
    return True


def remove_leftovers(key: str, owner: str) -> int:
    """Deletes `owner`'s flags (there are none while it serves); returns how many there were."""
    stale = list(board_dir().glob(f"disagg-cancel-{key}-{owner}.*"))
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


class Throttle:
    """`due()` is True at most once per `period_s`: at once on the first call, or only after a period."""

    def __init__(self, period_s: float, due_now: bool = True):
        self.period_s = period_s
        self._next = 0.0 if due_now else time.monotonic() + period_s

    def due(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.period_s
        return True
