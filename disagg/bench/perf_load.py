"""perf_analyzer keeping N streams of one model in flight: the load generator of `bench front`'s ceiling rounds.

The bench's own client (disagg.bench.front's Driver) is Python: every request on one gRPC stream, a callback
per response. Through tensorrt_llm_bls at 256 streams it spends 0.10-0.12 ms of CPU per token on the two cores
the server runs on, a fifth of what the whole path costs there. perf_analyzer, Triton's C++ load generator
(the one genai-perf runs), spent 0.05-0.06 side by side, and spreads its streams over a few connections.
Neither is free and they load the server differently: side by side, the BLS at 256 streams served 1.09-1.34x
the tokens/s under perf_analyzer, the aggregated engine called directly 0.71-0.81x, and at 64 streams each
served as much under both (docs/measurements.md). perf_analyzer is what a Triton user measures with, so it
drives the ceiling rounds. It ships in the tritonclient 2.51.0 wheel; tools/install_perf_analyzer.sh puts it
beside the venv's python, as `.ci/run` does.

perf_analyzer sends a set number of requests (`--request-count`), each next one as an answer ends, and exports
every request with its responses' timestamps and outputs. (Its time windows count only the requests answered
within each, and at 256 streams a request through the ensemble takes 10 s here.) It splits the count among its
threads, each of which stops sending once its share is sent, so towards the end fewer streams are in flight.
The window counted is the one in which all of them were, as the Driver counts its own: from the first moment
all were in flight to the last.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from disagg.engine.sampling import NO_END_ID

# The output whose value is the number of tokens a response carries: the text models' count, and the
# engine's sequence_length, which holds the tokens new in each streamed response (disagg.triton.engine_model).
TOKEN_COUNT = {"text": "num_output_tokens", "engine": "sequence_length"}


@dataclass(frozen=True)
class Exported:
    """One request as perf_analyzer exported it, times in seconds on its clock."""

    sent: float
    stamps: tuple[float, ...]
    tokens: tuple[int, ...]  # per response


@dataclass(frozen=True)
class PerfRun:
    requests: list[Exported]
    cpu_s: float  # perf_analyzer's own CPU time

    def window(self, streams: int) -> tuple[float, float]:
        """The first and the last moment `streams` requests were in flight (sent, not answered in full); the
        first request sent -> the last if there never were that many."""
        events = sorted([(r.sent, 1) for r in self.requests] + [(r.stamps[-1] if r.stamps else r.sent, -1) for r in self.requests])
        in_flight, full = 0, []
        for at, change in events:
            in_flight += change
            if in_flight >= streams:
                full.append(at)
        if not full:
            sent = [r.sent for r in self.requests]
            return min(sent), max(sent)
        return full[0], full[-1]


def command() -> tuple[Path, dict[str, str]]:
    """perf_analyzer beside this python, and the environment it runs in (the CUDA runtime library it links)."""
    binary = Path(sys.executable).parent / "perf_analyzer"
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is missing: run `bash tools/install_perf_analyzer.sh` (.ci/run does)")
    import nvidia.cuda_runtime

    lib = Path(nvidia.cuda_runtime.__path__[0]) / "lib"
    return binary, dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join(filter(None, [str(lib), os.environ.get("LD_LIBRARY_PATH")])))


def text_data(prompt: str, max_tokens: int) -> dict:
    """A text front's request as the Driver sends it (tools.stream_client.build_inputs): no end id, so every
    request streams `max_tokens` tokens."""
    return {"data": [{"text_input": [prompt], "max_tokens": [max_tokens], "stream": [True], "end_id": [NO_END_ID]}]}


def engine_data(ids: list[int], max_tokens: int) -> dict:
    """An engine model's request as the Driver sends it (disagg.bench.front.engine_inputs)."""
    return {"data": [{"input_ids": {"content": ids, "shape": [len(ids)]}, "input_lengths": [len(ids)],
                      "request_output_len": [max_tokens], "end_id": [NO_END_ID], "streaming": [True]}]}


def read_export(doc: dict, kind: str) -> list[Exported]:
    """The requests of perf_analyzer's profile export; `kind` ("text" or "engine") says which output counts
    a response's tokens."""
    count = TOKEN_COUNT[kind]
    [experiment] = doc["experiments"]
    return [Exported(r["timestamp"] / 1e9, tuple(t / 1e9 for t in r["response_timestamps"]),
                     tuple(int(o.get(count, 0)) for o in r["response_outputs"]))
            for r in experiment["requests"]]


def export(url: str, model: str, streams: int, requests: int, data: dict, workdir: Path, timeout_s: float,
           parameters: dict[str, str] | None = None) -> tuple[dict, float]:
    """`requests` requests of `model` with the inputs `data`, `streams` kept in flight over gRPC streaming;
    `parameters` are sent with each request as string parameters. perf_analyzer's profile export, and the CPU
    seconds it spent."""
    binary, env = command()
    workdir.mkdir(parents=True, exist_ok=True)
    inputs, exported = workdir / f"{model}-inputs.json", workdir / f"{model}-c{streams}.json"
    inputs.write_text(json.dumps(data))
    exported.unlink(missing_ok=True)
    cmd = [str(binary), "-m", model, "-i", "grpc", "--async", "--streaming", "-u", url, "--service-kind", "triton",
           "--input-data", str(inputs), "--concurrency-range", str(streams), "--request-count", str(requests),
           "--profile-export-file", str(exported)]
    for name, value in (parameters or {}).items():
        cmd += ["--request-parameter", f"{name}:{value}:string"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"perf_analyzer on {model} x{streams} ran past {timeout_s:.0f} s") from None
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0 or not exported.is_file():
        raise RuntimeError(f"perf_analyzer on {model} x{streams} failed ({done.returncode}):\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return json.loads(exported.read_text()), (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run(url: str, model: str, streams: int, requests: int, data: dict, kind: str, workdir: Path, timeout_s: float,
        parameters: dict[str, str] | None = None) -> PerfRun:
    """`export`'s run, its requests read as `kind` ("text" or "engine") counts their tokens."""
    doc, cpu = export(url, model, streams, requests, data, workdir, timeout_s, parameters)
    return PerfRun(read_export(doc, kind), cpu)
