"""One raw sample per request, as the Locust user measured it, and the metrics derived from it.

Everything is kept raw (perf_counter stamps of every streamed response) so a report can recompute any
metric exactly; the derived values (as docs/loadtest.md defines them):
    TTFT  send -> first response with non-empty text (an empty chunk, e.g. half a UTF-8 character,
          is not a token arrival)
    ITL   every gap between consecutive non-empty chunks, per chunk (N_out - 1 gaps per request)
    E2E   send -> end of the stream (final response received)
    TPOT  (E2E - TTFT) / (N_out - 1), per request; undefined when N_out < 2
    N_out number of non-empty chunks (one token each on this server); `chunk_count` is every response
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

    @property
    def deployment(self) -> str:
        return DEPLOYMENTS.get(self.model, self.model)

    @property
    def ok(self) -> bool:
        """Completed without error (it may still carry no text: every token decoded to nothing)."""
        return self.error is None

    @property
    def token_times(self) -> list[float]:
        return [t for t, n in zip(self.t_chunks, self.chunk_chars) if n > 0]

    @property
    def chunk_count(self) -> int:
        return len(self.t_chunks)

    @property
    def n_out(self) -> int:
        return sum(1 for n in self.chunk_chars if n > 0)

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
        return cls(**{**raw, "t_chunks": tuple(raw["t_chunks"]), "chunk_chars": tuple(raw["chunk_chars"])})


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
