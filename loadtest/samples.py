"""One raw sample per request, as the Locust user measured it, and the metrics derived from it.

Everything is kept raw (perf_counter stamps of every streamed response) so a report can recompute any
metric exactly; the derived values (as docs/loadtest.md defines them):
    TTFT  send -> first response that carries a token: one whose `num_output_tokens` (the server's own
          count) is above 0, or, where the server sends no count, whose text is not empty
    ITL   every gap between consecutive responses that carry tokens, per response
    E2E   send -> end of the stream (final response received)
    TPOT  (E2E - TTFT) / (N_out - 1), per request; undefined when N_out < 2
    N_out tokens received: the responses' `num_output_tokens` summed (else their non-empty chunks, one token
          each on this server); `chunk_count` is every response
Counted by tokens, not text: a response with half a UTF-8 character carries a token whose text comes with the
next one, and the engines that stand in for GPUs (disagg.engine.no_compute) draw ids the tokenizer mostly
decodes to nothing.
`time.perf_counter()` is CLOCK_MONOTONIC on Linux, shared by all processes, so stamps from the Locust
process line up with the metrics sampler's.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable

DEPLOYMENTS = {"aggregated": "aggregated", "ensemble": "disaggregated"}  # served model -> deployment


@dataclass(frozen=True)
class Sample:
    model: str  # served model: "aggregated" or "ensemble" (disaggregated)
    index: int  # request index in the workload: the same index is the same prompt in every run
    prompt_tokens: int
    max_tokens: int
    shared_prefix: bool
    rate: float | None  # target request rate of the run (None: closed loop)
    users: int
    scheduled: float | None  # open loop: planned send time, seconds after the run started
    start_unix: float  # wall clock at send, to line up with server logs
    t_send: float  # perf_counter at send
    t_chunks: tuple[float, ...]  # perf_counter at each streamed response
    chunk_chars: tuple[int, ...]  # text length of each response (0: no new text)
    t_end: float  # perf_counter when the stream ended or failed
    error: str | None = None
    chunk_tokens: tuple[int, ...] = ()  # tokens each response carried, as the server counted them (empty: not counted)

    @property
    def deployment(self) -> str:
        return DEPLOYMENTS.get(self.model, self.model)

    @property
    def ok(self) -> bool:
        """Completed without error (it may still carry no text: every token decoded to nothing)."""
        return self.error is None

    @property
    def _carried(self) -> tuple[int, ...]:
        """Per response, its tokens where the server counted them, else its text's length."""
        return self.chunk_tokens or self.chunk_chars

    @property
    def token_times(self) -> list[float]:
        return [t for t, n in zip(self.t_chunks, self._carried) if n > 0]

    @property
    def chunk_count(self) -> int:
        return len(self.t_chunks)

    @property
    def n_out(self) -> int:
        return sum(self.chunk_tokens) if self.chunk_tokens else sum(1 for n in self.chunk_chars if n > 0)

    @property
    def ttft(self) -> float | None:
        times = self.token_times
        return times[0] - self.t_send if times else None

    @property
    def e2e(self) -> float:
        return self.t_end - self.t_send

    @property
    def itl(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def tpot(self) -> float | None:
        n, ttft = self.n_out, self.ttft
        return (self.e2e - ttft) / (n - 1) if n > 1 and ttft is not None else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, raw: dict) -> Sample:
        return cls(**{**raw, "t_chunks": tuple(raw["t_chunks"]), "chunk_chars": tuple(raw["chunk_chars"]),
                      "chunk_tokens": tuple(raw.get("chunk_tokens", ()))})


def samples_path(samples_out: str | None, run_prefix: str | None = None) -> Path:
    """Where a Locust run writes its samples: `samples_out` when given; else `<run_prefix>.samples.jsonl`
    beside the run's own output (its --json-file or --csv prefix); else `samples.jsonl` in a new temporary
    directory. Never the working directory unasked."""
    if samples_out:
        return Path(samples_out)
    if run_prefix:
        return Path(f"{run_prefix}.samples.jsonl")
    return Path(tempfile.mkdtemp(prefix="disagg-locust-")) / "samples.jsonl"


def read_samples(paths: Iterable[str | Path]) -> list[Sample]:
    """Samples from JSONL files, in file order."""
    samples = []
    for path in paths:
        with open(path) as f:
            samples += [Sample.from_dict(json.loads(line)) for line in f if line.strip()]
    return samples
