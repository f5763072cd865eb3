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
