"""OpenAI's `stop`: the answer ends before the first occurrence of any stop sequence, which is not returned.

Matched on text, as vLLM matches it, because the ensemble's `stop_words` (TensorRT-LLM's token-sequence
matching) is not served by this deployment. While streaming, text that could still become the start of a
stop sequence is held back until it cannot, so no part of a stop sequence ever reaches the client.
"""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that may be sent now, whether a stop sequence was found)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((n for s in self.stops for n in range(min(len(s) - 1, len(buf)), 0, -1) if buf.endswith(s[:n])), default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """What was held back, once the answer has ended without a stop sequence."""
        text, self.held = self.held, ""
        return text
