"""What the orchestrator sends its client: token responses, streamed or one at the end.

Every response carries the tokens produced since the last one, preceded by up to `PREFIX_TOKENS` earlier
tokens (`prefix_length` says how many), so postprocessing can finish a UTF-8 character that straddles two
responses without keeping state. The last response is marked `is_final` (a streamed one carries no new
tokens), so bytes of a character the generation never finished come out as U+FFFD, as `tokenizer.decode`
gives them. A response every CANCEL_CHECK_S also names the request's cancel flag (`stream_id`, see
`cancel_board`): through the ensemble, postprocessing is the only model that learns of a client's
cancellation, and it checks when a response names the flag.
"""
from __future__ import annotations

import threading

import numpy as np
import triton_python_backend_utils as pb_utils

from disagg.triton import cancel_board
from disagg.triton.hop import CANCEL_CHECK_S
from disagg.triton.response_thread import ResponseThread

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
PREFIX_TOKENS = 4


class ClientStream:
    """What the client gets: token responses (streamed, or one at the end) with a UTF-8 prefix.

    Its tokens come from one thread at a time: the engine streams' reader threads, then the request's worker
    with the end. With `coalesce_backlog` N, a streamed response is given to Triton only once the one before
    it has been sent; those that came meanwhile wait here, and once N of them wait they go out as one (their
    tokens in order). A client that Triton sends to slower than its engine streams gets fewer, fuller
    responses instead of falling further behind; one that keeps up gets a token per response. No thread
    waits for it: each response, once sent, gives the next (`_sent`, on the thread that sent it)."""

    def __init__(self, out: ResponseThread, sender, streaming: bool, stream_id: str, coalesce_backlog: int = 0):
        self.out, self.sender = out, sender
        self.streaming = streaming
        self.stream_id = stream_id.encode()
        self.backlog = coalesce_backlog
        self.tokens: list[int] = []
        self.sent = 0  # tokens given to Triton
        self.check = cancel_board.Throttle(CANCEL_CHECK_S)
        # Reentrant: a response Triton sends at once calls `_sent` on the thread that gave it, under the lock.
        self._lock = threading.RLock()
        self._in_flight = False  # coalescing: a response given and not sent yet
        self._waiting: list[int] = []  # coalescing: the tokens of each response that came meanwhile
        self._final = False  # coalescing: the end came meanwhile, to go after the waiting ones
        self._draining = False  # coalescing: `_sent` is giving the waiting ones on this thread
        self._failed = False

    def emit(self, tokens: list[int]) -> None:
        with self._lock:
            self.tokens += tokens
            if not (self.streaming and tokens) or self._failed:
                return
            if self._in_flight:
                self._waiting.append(len(tokens))
            else:
                self._give(self.sent, len(self.tokens), final=False)

    def finish(self) -> None:
        """Streamed: a last response with no new tokens, which flushes a held-back partial character.
        Otherwise the whole answer in one response, even when it is empty."""
        with self._lock:
            if self._in_flight:
                self._final = True
            else:
                self._give(self.sent if self.streaming else 0, len(self.tokens), final=True)

    def fail(self, message: str) -> None:
        with self._lock:
            self._failed = True  # no response waiting here goes out after the error
            self.out.fail(self.sender, message)

    def _give(self, start: int, end: int, final: bool) -> None:
        """Gives Triton tokens[start:end] (under the lock)."""
        prefix = max(0, start - PREFIX_TOKENS)
        outputs = self._outputs(self.tokens[prefix:end], start - prefix, final)
        self.sent = end
        self._in_flight = bool(self.backlog) and not final
        self.out.send(self.sender, outputs, FINAL if final else 0, self._sent if self._in_flight else None)

    def _sent(self) -> None:
        """The response in flight has been sent: the next goes, the waiting ones as one once there are enough.
        A response Triton sends at once calls this again inside `_give`: that call only marks it sent, and the
        loop here gives the next, so a long backlog sent one by one does not deepen the stack per response."""
        with self._lock:
            self._in_flight = False
            if self._draining:
                return
            self._draining = True
            try:
                while not self._in_flight and not self._failed:
                    if self._waiting:
                        merged = len(self._waiting) if len(self._waiting) >= self.backlog else 1
                        end = self.sent + sum(self._waiting[:merged])
                        del self._waiting[:merged]
                        self._give(self.sent, end, final=False)
                    elif self._final:
                        self._final = False
                        self._give(self.sent, len(self.tokens), final=True)
                    else:
                        break
            finally:
                self._draining = False

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
