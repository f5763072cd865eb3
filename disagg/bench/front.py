"""`python -m disagg.bench front`: what the serving front costs, measured with the engines' compute skipped.

The engines run with DISAGG_SKIP_COMPUTE=1 (disagg.engine.no_compute): their contract, scheduling, KV
bookkeeping and handoffs are unchanged, only the forward pass is gone, so a token costs what the stack
around the engine makes it cost. Per concurrency (streams kept in flight, closed loop, `--seconds` each, or
until `--min-requests` sent in that time have completed) and per path, side by side in one run:

    ensemble             text in, text out: preprocessing -> orchestrator -> prefill, decode -> postprocessing
    tensorrt_llm_bls     text in, text out, the same request and answer: one model tokenizes, orchestrates
                         and detokenizes (orchestrator.bls)
    prefill + decode     the same engines called directly with token ids, the client doing the handoff
    aggregated           text in, text out: the aggregated ensemble, same front, one engine
    aggregated_engine    that engine called directly
    front_floor          token ids in, the first token out: the least a Python model between client and engine
                         can add (disagg.bench.front_floor), in the alternated rounds only
    tensorrt_llm_bls_coalesced
                         tensorrt_llm_bls with `coalesce_backlog` (`--coalesced-bls`, default 2): a stream whose
                         responses wait behind the model gets them merged, one that keeps up gets a token per
                         response; a path and a front of the ceiling rounds of its own, so the two are compared
                         on the same machine in the same minutes

`--step-ms 20` makes every engine step take 20 ms without using the CPU, as a GPU's decode step would, so
the engines' own cost does not compete with the front for this machine's cores.

Printed per row: output tokens/s (tokens received in the window / window), TTFT p50, and p50 over requests
of their mean gap between token responses and of their time per token after the first response (the same
unless responses carry several tokens: `--coalesce-backlog`); then ensemble vs direct at one stream (TTFT
and per-token cost added) and at each level (tokens/s ratio), and where the CPU goes: CPU ms per output token of each
process (tritonserver, each model's Python stub, this client) over the window of the highest level,
which is what limits the front on a machine whose cores it saturates. The front's ceiling is then set against
the engines' own: `--ceiling-rounds` rounds, each timing the decode tokens/s of the reference engine on the
`bench-100mb` model, computing (its best of batch 16 and 64), and each front at the level where its row served
most, in turn (the first rotating), and the engines called directly at theirs: no front serves more than they
do in the same round, so each front's share of them says how far it is from the bound. perf_analyzer, Triton's
C++ load generator (the one genai-perf runs), drives those rounds (`--ceiling-client`; disagg.bench.perf_load),
each front at the level where perf_analyzer served it most, timed once per level above one stream before the
rounds; its bound is aggregated_engine called directly, since it cannot hand prefill's answer to decode
(`--ceiling-client python`: this bench's client, each front at its row's best level, and the prefill + decode
bound). This machine's speed
moves by up to 2x over minutes, which a ratio of figures timed minutes apart takes for the front's; within a
round it moves both alike, so the ratio is given per round, with the median. Last, `--alternate` rounds of one
request on each path in turn give the one-stream comparison again, as the median of the rounds' differences
with its 95% interval, and their quartiles, which a drift in the machine's speed between two rows does not
move. Each request measured there follows one on its path, closed-loop, as at one stream in the rows: while the
other paths run, a path's Python models sit idle for seconds, and the first request after that pays for
waking them (front_floor's TTFT added was +1.0 to +1.6 ms so, +0.4 to +0.7 right after a request;
docs/measurements.md), which the engines, serving every path, never do. That warm-up's TTFT is printed beside
("after idling"). front_floor's rounds say how much of tensorrt_llm_bls's added TTFT any Python model and engine hop would
add here, and how much is its own; so does each front model's `disagg_first_hop_seconds` over those rounds (a
request's arrival in it -> its first engine request sent: validating, tokenizing, routing, the send), printed
after them. With `--trace`, Triton traces those rounds' requests (tensorrt_llm_bls, the coalescing BLS,
front_floor and prefill), and where each path's first token spent its time is printed segment by segment,
between Triton's own stamps and the client's times (disagg.bench.first_token_trace): what any Python model and
HTTP hop cost, against what the front's own code does. The summary ends with each text front against the front's targets (TTFT added
<= 1.5 ms and time per token <= 0.1 ms at one stream, from the alternated rounds; 3x the engine's peak in every
ceiling round), a line each, and the bounds this machine sets them: front_floor's TTFT and the engines called
directly in the ceiling rounds.
The rows and the alternated rounds are saved to `<out>/front.json`, from whose rows `loadtest plan --front`
sizes a GPU deployment's front (disagg.planner.front_cost), and drawn with the ceiling rounds in
`<out>/front.png` (disagg.bench.front_plot).

One client drives every path of the rows and the alternated rounds the same way (one gRPC stream, requests told
apart by id) and shares the machine's cores with the server: at high concurrency it is part of what is measured,
for every path alike; in the ceiling rounds perf_analyzer is, for less.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import psutil
import tritonclient.grpc as grpcclient
import yaml
from tqdm import tqdm

from disagg.bench import first_token_trace, perf_load
from disagg.bench.front_plot import FrontFigure, plot
from disagg.engine.no_compute import skipped_compute
from disagg.engine.sampling import NO_END_ID
from disagg.planner.front_cost import shares
from disagg.serve.metrics import Histogram, histograms, scrape
from disagg.triton.credential import PARAMETER
from tools.stream_client import build_inputs, end_stream

LEVELS = (1, 16, 64, 256)
DIRECT = "prefill + decode"  # the engines called directly: no front serves more than they do beside it
ENGINE_DIRECT = "aggregated_engine"  # an engine called directly, one request each: the bound perf_analyzer can drive
PATHS = ("ensemble", "tensorrt_llm_bls", DIRECT, "aggregated", ENGINE_DIRECT)
FLOOR = "front_floor"  # a path of the alternated rounds only: it answers the first token, no more
COALESCED = "tensorrt_llm_bls_coalesced"  # tensorrt_llm_bls with coalesce_backlog (`install_coalesced`)
TEXT_PATHS = ("ensemble", "tensorrt_llm_bls", "aggregated", COALESCED)
PROMPT = "It was the best of times, it was the worst of times, it was the age of wisdom"
CEILING_BATCHES = [16, 64]  # the computing decode engine's batches timed beside the front
FRONTS = ("ensemble", "tensorrt_llm_bls")  # a built repository's text fronts that stream through both engines
# The paths a ceiling round times (those of a run's paths), by its load generator: the text fronts and, as the
# bound no front passes, the engines called directly (perf_analyzer cannot hand prefill's answer to decode).
CEILING_PATHS = {"perf_analyzer": (*FRONTS, COALESCED, ENGINE_DIRECT), "python": (*FRONTS, COALESCED, DIRECT)}
BOUNDS = (DIRECT, ENGINE_DIRECT)
ENGINE = "computing decode engine"  # the engine's turn in a ceiling round
# The models whose requests `--trace` has Triton trace, and the path each serves: the fronts that hop to
# prefill over HTTP, and prefill, which the direct path calls first (disagg.bench.first_token_trace).
TRACED = {"tensorrt_llm_bls": "tensorrt_llm_bls", COALESCED: COALESCED, FLOOR: FLOOR, first_token_trace.ENGINE: DIRECT}
FIRST_HOP = "disagg_first_hop_seconds"  # an orchestrator's time from a request's arrival to its first engine request
# The model of each path whose stub times that (the ensembles' orchestrators, the BLS models).
FIRST_HOP_MODEL = {"ensemble": "disagg_orchestrator", "tensorrt_llm_bls": "tensorrt_llm_bls", "aggregated": "aggregated_orchestrator",
                   COALESCED: COALESCED}
CEILING_TARGET = 3.0  # a front's ceiling should be this many times the engine's peak: each front's rounds are counted against it
TTFT_TARGET_MS = 1.5  # the most TTFT a front should add to the engines called directly, one request at a time
TOKEN_TARGET_MS = 0.1  # the most time per token it should add, one request at a time
MAX_WINDOW_S = 60.0  # a row's window at most, however few requests it has completed
PERF_TIMEOUT_S = 600.0  # a perf_analyzer run at most
# perf_analyzer's window, in rows' `seconds`: requests of equal length started together end together, so the
# streams turn over in waves (at 256 streams about 5 s each here), and a window one row long held one or two.
PERF_WINDOWS = 2
DRAIN_S = 30.0  # after a window: how long requests still in flight may take to finish


def front_spec(config: Path, out: Path, max_streams: int, coalesce_backlog: int = 0):
    """`config` (cpu-tiny) with room for `max_streams` sequences in every engine and orchestrator, the
    orchestrators' `coalesce_backlog` and tensorrt_llm_bls, built into <out>/."""
    from disagg.spec import load_spec

    raw = yaml.safe_load(config.read_text())
    for role in raw["roles"].values():
        role["max_batch_size"] = max(role["max_batch_size"], max_streams)
        role["max_num_tokens"] = max(role["max_num_tokens"], 2 * max_streams)
        role["kv_cache_blocks"] = max(role["kv_cache_blocks"], 8 * max_streams)
    raw["orchestrator"]["max_in_flight"] = max(raw["orchestrator"]["max_in_flight"], 2 * max_streams)
    raw["orchestrator"]["coalesce_backlog"] = coalesce_backlog
    raw["orchestrator"]["bls"] = True
    raw["output"] = {"build_dir": str(out), "model_repository": str(out / "model_repository")}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "spec.yaml"
    path.write_text(f"# {config} for `python -m disagg.bench front`: room for {max_streams} streams\n" + yaml.safe_dump(raw, sort_keys=False))
    return load_spec(path)


FLOOR_CONFIG = f"""# disagg.bench.front_floor, for `python -m disagg.bench front` only
name: "{FLOOR}"
backend: "python"
max_batch_size: 32
model_transaction_policy {{ decoupled: true }}
input {{ name: "input_ids" data_type: TYPE_INT32 dims: [ -1 ] allow_ragged_batch: true }}
input {{ name: "input_lengths" data_type: TYPE_INT32 dims: [ 1 ] }}
input {{ name: "request_output_len" data_type: TYPE_INT32 dims: [ 1 ] }}
input {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }}
input {{ name: "streaming" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
output {{ name: "output_ids" data_type: TYPE_INT32 dims: [ -1, -1 ] }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def install_floor(repository: Path) -> None:
    """Adds front_floor to a built repository (its prefill engine model is `prefill`)."""
    (repository / FLOOR / "1").mkdir(parents=True, exist_ok=True)
    (repository / FLOOR / "config.pbtxt").write_text(FLOOR_CONFIG)
    (repository / FLOOR / "1" / "model.py").write_text("from disagg.bench.front_floor import TritonPythonModel  # noqa: F401\n")


def install_coalesced(repository: Path, backlog: int) -> None:
    """Adds COALESCED to a built repository: its tensorrt_llm_bls under another name, with `coalesce_backlog`
    set to `backlog`."""
    from google.protobuf import text_format

    from disagg.repository import parse_config

    source, target = repository / "tensorrt_llm_bls", repository / COALESCED
    config = parse_config("tensorrt_llm_bls", (source / "config.pbtxt").read_text())
    config.name = COALESCED
    config.parameters["coalesce_backlog"].string_value = str(backlog)
    (target / "1").mkdir(parents=True, exist_ok=True)
    (target / "config.pbtxt").write_text(f"# tensorrt_llm_bls with coalesce_backlog {backlog}, for `python -m disagg.bench front` only\n"
                                         + text_format.MessageToString(config))
    (target / "1" / "model.py").write_text((source / "1" / "model.py").read_text())


def _tensor(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


def engine_inputs(ids: list[int], max_tokens: int, params: np.ndarray | None = None) -> list[grpcclient.InferInput]:
    inputs = [
        _tensor("input_ids", np.array([ids], dtype=np.int32), "INT32"),
        _tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
        _tensor("request_output_len", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _tensor("end_id", np.array([[NO_END_ID]], dtype=np.int32), "INT32"),
        _tensor("streaming", np.array([[True]]), "BOOL"),
    ]
    if params is not None:
        inputs.append(_tensor("context_phase_params", params.reshape(1, -1), "UINT8"))
    return inputs


@dataclass
class Flight:
    """One request in flight: when it was sent, when each of its token responses came and how many tokens
    each carried."""

    sent: float
    phase: str  # "text" | "engine" | "prefill" | "decode"
    measured: bool = True  # False: a warm-up request of its row (`Driver.run`'s `warm`), counted in nothing
    stamps: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def per_token_s(self) -> float | None:
        """Time per token after the first response: responses that carry several tokens (coalesced) count
        each of them; None with nothing after the first response."""
        later = sum(self.counts[1:])
        return (self.stamps[-1] - self.stamps[0]) / later if later else None


@dataclass
class Level:
    path: str
    streams: int
    tokens_per_s: float
    ttft_ms: float
    gap_ms: float
    token_ms: float  # p50 over requests of Flight.per_token_s
    completed: int
    errors: int
    cpu_ms_per_token: dict[str, float] = field(default_factory=dict)  # by process, over the window
    round: int | None = None  # a single request of the alternated rounds (`measure`'s `alternate`)
    # An alternated round's warm-up: the TTFT of the request on the path just before the one measured, the first
    # there after the path sat idle while the others ran.
    idle_ttft_ms: float = float("nan")
    client: str = "python"  # what drove the row: the Driver, or "perf_analyzer" (the ceiling rounds and their levels)


@dataclass
class CeilingRound:
    """One round of `measure`'s `ceiling_rounds`: the computing decode engine's tokens/s by batch and each
    front's, at its best level, timed one after the other."""

    round: int
    engine: dict[int, float]
    fronts: dict[str, Level]

    def ratio(self, front: str) -> float:
        return self.fronts[front].tokens_per_s / max(self.engine.values())


def cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the server, each of its Python-backend stubs (named by model) and this process."""
    server = psutil.Process(server_pid)
    used = {}
    for process, name in [(server, "tritonserver"), (psutil.Process(), "client"),
                          *((child, _stub_model(child)) for child in server.children(recursive=True))]:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[name] = used.get(name, 0.0) + times.user + times.system
    return used


def _stub_model(process: psutil.Process) -> str:
    """A stub's model: its command line names <repository>/<model>/<version>/model.py."""
    try:
        return "stub " + Path(process.cmdline()[1]).parts[-3]
    except (psutil.Error, IndexError):
        return "other"


class Driver:
    """Keeps N requests of one path in flight on one gRPC stream for a window; the response callback does
    the bookkeeping and sends each next request (and, direct, each decode after its prefill)."""

    def __init__(self, url: str, internal_key: str, ids: list[int], max_tokens: int, server_pid: int):
        self.ids, self.max_tokens, self.server_pid = ids, max_tokens, server_pid
        self.credential = {PARAMETER: internal_key}
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._count = 0
        # every request measured so far: when it was sent and its first token came (perf_counter, CLOCK_MONOTONIC as
        # Triton's trace stamps), for their traces (`--trace`)
        self.first_tokens: dict[str, tuple[float, float]] = {}
        self._reset("ensemble", 0.0)

    def _reset(self, path: str, until: float, max_requests: int | None = None, warm: int = 0) -> None:
        """A new row's state."""
        self.path, self.until = path, until
        self.left = max_requests  # requests the row may still send (None: no limit)
        self.warm_left = warm  # of those, the first sent are warm-ups
        self.idle_ttfts: list[float] = []  # the warm-ups' TTFTs
        self.flights: dict[str, Flight] = {}
        self.tokens_in_window, self.window = 0, (0.0, until)
        self.ttfts: list[float] = []
        self.gaps: list[float] = []
        self.per_token: list[float] = []
        self.errors = 0

    def run(self, path: str, streams: int, seconds: float, min_requests: int = 0, max_requests: int | None = None,
            warm: int = 0) -> Level:
        """One row: `streams` requests kept in flight for `seconds`, or longer, up to MAX_WINDOW_S, until
        `min_requests` sent in the window have completed (one stream with 20 ms steps completes four 64-token
        requests in 5 s, too few for a median); no more than `max_requests` sent, the first `warm` of them
        warm-ups, counted in nothing (of `max_requests`, too)."""
        start = time.perf_counter()
        with self._lock:
            self._reset(path, start + MAX_WINDOW_S, None if max_requests is None else max_requests + warm, warm)
            self.window = (start, start + MAX_WINDOW_S)
            before = cpu_seconds(self.server_pid)
            for _ in range(streams):
                self._send_new(start)
        time.sleep(max(0.0, start + seconds - time.perf_counter()))
        while len(self.ttfts) < min_requests and time.perf_counter() < start + MAX_WINDOW_S:
            time.sleep(0.05)
        with self._lock:
            end = time.perf_counter()
            self.until, self.window = end, (start, end)  # no request sent, no token counted, after this
        after = cpu_seconds(self.server_pid)
        with self._lock:
            if not self._idle.wait_for(lambda: not self.flights, timeout=DRAIN_S):
                raise RuntimeError(f"{path} x{streams}: {len(self.flights)} requests unfinished {DRAIN_S:.0f} s after the window")
        tokens = max(1, self.tokens_in_window)
        cpu = {name: (after[name] - before.get(name, 0.0)) * 1e3 / tokens for name in after}
        return Level(path, streams, self.tokens_in_window / (end - start), _median_ms(self.ttfts), _median_ms(self.gaps),
                     _median_ms(self.per_token), len(self.ttfts), self.errors, cpu, idle_ttft_ms=_median_ms(self.idle_ttfts))

    def close(self) -> None:
        """Ends the stream, cancelling it only while requests are in flight: a server that has stopped
        answering (a crashed one can deadlock in its signal handler) would never end it."""
        with self._lock:
            ended, self.until = not self.flights, 0.0  # and no request sent after this
        end_stream(self.client, request_ended=ended)

    # -- under the lock, from run() or the stream's callback thread ----------------------------------
    def _send_new(self, now: float) -> None:
        if self.left is not None:
            if not self.left:
                return
            self.left -= 1
        self._count += 1
        request_id = str(self._count)
        measured = not self.warm_left
        if not measured:
            self.warm_left -= 1
        if self.path in TEXT_PATHS:
            self.flights[request_id] = Flight(now, "text", measured)
            inputs = build_inputs(PROMPT, self.max_tokens, end_id=NO_END_ID)
            self.client.async_stream_infer(self.path, inputs, request_id=request_id, enable_empty_final_response=True)
        elif self.path == ENGINE_DIRECT:
            self.flights[request_id] = Flight(now, "engine", measured)
            self._send_engine(ENGINE_DIRECT, request_id, "context_and_generation", None)
        elif self.path == FLOOR:
            self.flights[request_id] = Flight(now, "engine", measured)
            self._send_engine(FLOOR, request_id, "context_and_generation", None)  # front_floor asks for one token
        else:
            self.flights[request_id] = Flight(now, "prefill", measured)
            self._send_engine("prefill", request_id, "context_only", None)

    def _send_engine(self, model: str, request_id: str, request_type: str, params: np.ndarray | None) -> None:
        self.client.async_stream_infer(
            model, engine_inputs(self.ids, self.max_tokens, params), request_id=request_id,
            parameters={"request_type": request_type, **self.credential}, enable_empty_final_response=True,
        )

    def _on_response(self, result, error) -> None:
        now = time.perf_counter()
        with self._lock:
            if error is not None:
                self.errors += 1
                if self.errors == 1:
                    print(f"  {self.path}: {error}", flush=True)
                request_id = next(iter(self.flights), None)  # the stream no longer says whose it was
                if request_id is not None:
                    self._finish(request_id, now, failed=True)
                return
            response = result.get_response()
            flight = self.flights.get(response.id)
            if flight is None:
                return
            tokens = self._tokens(result, flight)
            if tokens:
                flight.stamps.append(now)
                flight.counts.append(tokens)
                if flight.measured and self.window[0] <= now <= self.window[1]:
                    self.tokens_in_window += tokens
            if not response.parameters["triton_final_response"].bool_param:
                return
            if flight.phase == "prefill":
                flight.phase = "decode"
                self._send_engine("decode", response.id, "generation_only", result.as_numpy("context_phase_params"))
                return
            self._finish(response.id, now, failed=False)

    def _tokens(self, result, flight: Flight) -> int:
        if flight.phase == "text":
            counts = result.as_numpy("num_output_tokens")
            return 0 if counts is None else int(counts.sum())
        ids = result.as_numpy("output_ids")
        n = 0 if ids is None else ids.size
        if flight.phase == "decode" and len(flight.stamps) == 1 and n:
            n -= 1  # a generation-only stream starts with the context phase's token again
        return n

    def _finish(self, request_id: str, now: float, failed: bool) -> None:
        flight = self.flights.pop(request_id)
        if not failed and not flight.measured and flight.stamps:
            self.idle_ttfts.append(flight.stamps[0] - flight.sent)
        elif not failed and flight.stamps and flight.sent >= self.window[0]:
            self.ttfts.append(flight.stamps[0] - flight.sent)
            self.first_tokens[request_id] = (flight.sent, flight.stamps[0])
            if len(flight.stamps) > 1:
                self.gaps.append(float(np.mean(np.diff(flight.stamps))))
                self.per_token.append(flight.per_token_s())
        if now < self.until:
            self._send_new(now)
        if not self.flights:
            self._idle.notify_all()


def _median_ms(seconds: list[float]) -> float:
    return float(np.median(seconds)) * 1e3 if seconds else float("nan")


def _row_line(r: Level) -> str:
    return f"  {r.path:<27}{r.streams:>8}{r.tokens_per_s:>11.0f}{r.ttft_ms:>10.2f}{r.gap_ms:>9.3f}{r.token_ms:>11.3f}{r.completed:>10}{r.errors:>8}"


def perf_level(path: str, streams: int, run: perf_load.PerfRun, server_cpu_s: dict[str, float]) -> Level:
    """A row of perf_analyzer's run, counted as the Driver counts its own: the tokens received in the window
    in which all `streams` were in flight, and the TTFT, gap and time per token of every request answered;
    CPU per token received in the whole run: the server's processes and this one (`server_cpu_s`, over the
    run) and perf_analyzer's own. A request answered with no token counts as an error."""
    start, end = run.window(streams)
    phase = "engine" if path == ENGINE_DIRECT else "text"
    flights = [Flight(r.sent, phase, stamps=[t for t, n in zip(r.stamps, r.tokens) if n], counts=[n for n in r.tokens if n])
               for r in run.requests]
    answered = [f for f in flights if f.stamps]
    in_window = sum(n for f in flights for t, n in zip(f.stamps, f.counts) if start <= t <= end)
    tokens = max(1, sum(map(sum, (f.counts for f in flights))))
    cpu = {name: s * 1e3 / tokens for name, s in {**server_cpu_s, "perf_analyzer": run.cpu_s}.items()}
    return Level(path, streams, in_window / max(end - start, 1e-9), _median_ms([f.stamps[0] - f.sent for f in answered]),
                 _median_ms([float(np.mean(np.diff(f.stamps))) for f in answered if len(f.stamps) > 1]),
                 _median_ms([f.per_token_s() for f in answered if len(f.stamps) > 1]), len(answered),
                 len(flights) - len(answered), cpu, client="perf_analyzer")


def perf_driver(server, ids: list[int], max_tokens: int, seconds: float, workdir: Path) -> Callable[[Level], Level]:
    """Drives a text front or ENGINE_DIRECT with perf_analyzer at the streams of the Driver's `row`: the same
    requests, and as many as keep the streams busy for PERF_WINDOWS x `seconds` at the row's rate (the
    Driver's `min_requests` has no part in it); the CPU each process of the server, this one ("bench", idle
    but for its stream) and perf_analyzer spent."""
    def drive(row: Level) -> Level:
        path, streams = row.path, row.streams
        if path in TEXT_PATHS:
            data, kind, parameters = perf_load.text_data(PROMPT, max_tokens), "text", None
        elif path == ENGINE_DIRECT:
            data, kind = perf_load.engine_data(ids, max_tokens), "engine"
            parameters = {"request_type": "context_and_generation", PARAMETER: server.internal_key}
        else:
            raise ValueError(f"perf_analyzer drives a text front or {ENGINE_DIRECT}, not {path}")
        before = cpu_seconds(server.process.pid)
        expected_s = streams * max_tokens / max(row.tokens_per_s, 1.0)  # a request's time in flight, at the row's rate
        requests = streams + max(streams, math.ceil(row.tokens_per_s / max_tokens * seconds * PERF_WINDOWS))
        run = perf_load.run(server.grpc_url, path, streams, requests, data, kind, workdir,
                            timeout_s=min(PERF_TIMEOUT_S, 120 + 10 * (expected_s + seconds * PERF_WINDOWS)), parameters=parameters)
        after = cpu_seconds(server.process.pid)
        used = {("bench" if name == "client" else name): after[name] - before.get(name, 0.0) for name in after}
        return perf_level(path, streams, run, used)
    return drive


def measure(config: Path, out: Path, levels: tuple[int, ...], seconds: float, max_tokens: int, step_ms: float = 0.0,
            coalesce_backlog: int = 0, paths: tuple[str, ...] = PATHS, min_requests: int = 0, alternate: int = 0,
            ceiling_rounds: int = 0, engine_peak: Callable[[], dict[int, float]] | None = None, coalesced_bls: int = 0,
            ceiling_client: str = "perf_analyzer", trace: bool = False) -> tuple[list[Level], list[CeilingRound]]:
    """A row per level and path (and COALESCED, with `coalesced_bls`: its coalesce_backlog); then `ceiling_rounds`
    rounds of `engine_peak` (the computing decode engine's tokens/s by batch) and each path of
    CEILING_PATHS[ceiling_client] among the paths at its best level, driven by `ceiling_client`; then, with `alternate`, that many
    rounds of one request on each path and front_floor in turn (the first path rotating), each a row of its own
    with its `round`: a drift in the machine's speed, which moves a whole row's TTFT by milliseconds here, then
    hits every path's request of a round alike. Each follows a warm-up request on its path (closed-loop, as one
    stream's requests follow each other), whose TTFT the row keeps as `idle_ttft_ms`. With `trace`, Triton traces
    the alternated rounds' requests, and where each first token's time went is printed and saved to
    `<out>/first_token.json` (disagg.bench.first_token_trace)."""
    from disagg.cli import build
    from disagg.serve.server import TritonServer
    from disagg.text import encode_prompt, load_tokenizer

    if ceiling_rounds and ceiling_client == "perf_analyzer":
        perf_load.command()  # missing, it fails now, not after the rows
    spec = front_spec(config, out, max(levels), coalesce_backlog)
    build(spec, log=lambda _msg: None)
    install_floor(spec.model_repository)
    if coalesced_bls:
        install_coalesced(spec.model_repository, coalesced_bls)
        paths = (*paths, COALESCED)
    ids = encode_prompt(load_tokenizer(spec.model.path), PROMPT)
    rows, ceilings = [], []
    (out / "server.log").unlink(missing_ok=True)  # TritonServer appends: an earlier run's errors are not this one's
    trace_file = out / "trace.json"
    trace_file.unlink(missing_ok=True)  # the server writes it as it exits
    traced = {model: path for model, path in TRACED.items() if path in (*paths, FLOOR)} if trace and alternate else {}
    with skipped_compute(step_ms), TritonServer(spec.model_repository, log_path=out / "server.log",
                                                extra_args=first_token_trace.server_args(trace_file) if traced else ()) as server:
        driver = Driver(server.grpc_url, server.internal_key, ids, max_tokens, server.process.pid)
        try:
            rounds = (*paths, FLOOR) if alternate else paths
            for path in rounds:
                driver.run(path, 4, 1.0)  # warm-up: connections, first-call imports
            for streams in levels:
                for path in paths:
                    rows.append(driver.run(path, streams, seconds, min_requests))
                    print(_row_line(rows[-1]), flush=True)
            ceiling_paths = [front for front in CEILING_PATHS[ceiling_client] if front in paths] if ceiling_rounds else []
            drive = (perf_driver(server, ids, max_tokens, seconds, out / "perf_analyzer") if ceiling_client == "perf_analyzer"
                     else lambda row: driver.run(row.path, row.streams, seconds, min_requests))
            if ceiling_client == "perf_analyzer" and ceiling_paths:
                # Its best level is its own: the BLS can serve most at 256 streams under perf_analyzer and at 64
                # under the Driver (docs/measurements.md).
                print("  the ceiling rounds' paths driven by perf_analyzer, each level above 1 stream once, for each one's best level:", flush=True)
                for row in [r for r in rows if r.path in ceiling_paths and (r.streams > 1 or max(levels) == 1)]:
                    rows.append(drive(row))
                    print(_row_line(rows[-1]), flush=True)
            best = {front: max((r for r in rows if r.path == front and r.client == ceiling_client), key=lambda r: r.tokens_per_s)
                    for front in ceiling_paths}
            for i in range(ceiling_rounds):
                ceilings.append(ceiling_round(i, best, drive, engine_peak))
                c = ceilings[-1]
                print(f"  ceiling round {i + 1}/{ceiling_rounds}: the {ENGINE} {max(c.engine.values()):.0f} tokens/s, "
                      + ", ".join(f"{front} {level.tokens_per_s:.0f} ({c.ratio(front):.2f}x)" for front, level in c.fronts.items()),
                      flush=True)
            if alternate:
                before = first_hop_reading(server.metrics_url)
                first_token_trace.switch(driver.client, list(traced), on=True)
                for i in tqdm(range(alternate), desc="alternated rounds", unit="round", disable=None, leave=False):
                    for path in rotated(rounds, i):
                        rows.append(replace(driver.run(path, 1, 0.0, min_requests=1, max_requests=1, warm=1), round=i))
                first_token_trace.switch(driver.client, list(traced), on=False)
                line = first_hops(before, first_hop_reading(server.metrics_url), paths)
                if line:
                    print(line, flush=True)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; the server's log ({server.log_path}):\n{server.log_excerpt(5)}") from exc
        finally:
            driver.close()
    if traced:
        found = first_token_trace.timelines(first_token_trace.read(trace_file), traced, driver.first_tokens)
        for line in first_token_trace.table(found, DIRECT):
            print(line, flush=True)
        (out / "first_token.json").write_text(json.dumps(found, indent=1))
    return rows, ceilings


def first_hop_reading(metrics_url: str) -> dict[str, Histogram]:
    """The fronts' FIRST_HOP series as the server shows them once what they timed is out: an orchestrator's
    metric updates go 50 ms after they are queued (disagg.triton.metrics.Updater)."""
    time.sleep(0.2)
    return histograms(scrape(metrics_url), FIRST_HOP)


def first_hops(before: dict[str, Histogram], after: dict[str, Histogram], paths: tuple[str, ...]) -> str | None:
    """Each front's own share of its TTFT over the alternated rounds, as its stub timed it: a request's arrival
    in its model -> its first engine request sent (`FIRST_HOP`, by instance), warm-ups included."""
    parts = []
    for path in paths:
        model = FIRST_HOP_MODEL.get(path)
        seen = [h.since(before.get(instance)) for instance, h in after.items() if instance.rsplit("_", 2)[0] == model]
        if seen and (timed := functools.reduce(Histogram.plus, seen)).count:
            parts.append(f"{path} p50 {timed.quantile(0.5) * 1e3:.2f} ms (mean {timed.sum / timed.count * 1e3:.2f}, "
                         f"{timed.count:.0f} requests)")
    if not parts:
        return None
    return ("  a request's arrival in the front's model -> its first engine request sent, the alternated rounds' requests as "
            f"the model timed them ({FIRST_HOP}; p50 from its buckets): " + ", ".join(parts))


def ordered(paths) -> list[str]:
    """A ceiling round's paths in the order they are shown: the fronts, then the bound."""
    order = (*FRONTS, COALESCED, *BOUNDS)
    return sorted(paths, key=lambda path: order.index(path) if path in order else len(order))


def rotated(items: tuple[str, ...], i: int) -> tuple[str, ...]:
    """`items` starting at the i-th, so that no path always goes first."""
    return items[i % len(items):] + items[:i % len(items)]


def ceiling_round(i: int, best: dict[str, Level], drive: Callable[[Level], Level],
                  engine_peak: Callable[[], dict[int, float]]) -> CeilingRound:
    """The engine's turn and each front's as in `best[front]` (its row that served most), in rotated order."""
    engine, fronts = {}, {}
    for turn in rotated((ENGINE, *best), i):
        if turn == ENGINE:
            engine = engine_peak()
        else:
            fronts[turn] = drive(best[turn])
    return CeilingRound(i, engine, fronts)


def engine_ceiling(root: Path, batches: list[int]) -> dict[int, float]:
    """Decode tokens/s of the computing reference engine on bench-100mb (disagg.bench.engine)."""
    from disagg.bench.engine import decode_tokens_per_s

    return decode_tokens_per_s(root, "bench-100mb", 256, 32, batches)


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of `values` (a fixed seed, so a run prints it the same way
    twice): how far the p50 of this few rounds may be from the machine's, against a target a millisecond wide."""
    samples = np.random.default_rng(0).choice(values, size=(resamples, len(values)))
    low, high = np.percentile(np.median(samples, axis=1), (2.5, 97.5))
    return float(low), float(high)


def _differences(rounds: list[Level], front: str, direct: str, ttft: str = "ttft_ms") -> tuple[list[float], list[float]]:
    """What `front` added to `direct` in each alternated round both completed: TTFT (`ttft`: of the request
    measured, or "idle_ttft_ms", of the warm-up before it), and time per token where both have one (front_floor
    answers one token: none)."""
    by = {(r.path, r.round): r for r in rounds}
    pairs = [(by[(front, i)], by[(direct, i)]) for i in sorted({r.round for r in rounds})
             if (front, i) in by and (direct, i) in by and by[(front, i)].completed and by[(direct, i)].completed]
    added = [getattr(f, ttft) - getattr(d, ttft) for f, d in pairs]
    return ([a for a in added if not math.isnan(a)],
            [f.token_ms - d.token_ms for f, d in pairs if not math.isnan(f.token_ms - d.token_ms)])


def _paired(rounds: list[Level], front: str, direct: str) -> str | None:
    """TTFT and time per token that `front` added to `direct` in the alternated rounds: the median of the
    rounds' differences, with its 95% interval for TTFT, and their quartiles; then the TTFT it added to the
    first request after each path sat idle (the round's warm-up)."""
    differences, token = _differences(rounds, front, direct)
    if not differences:
        return None
    ttft, interval = np.percentile(differences, (25, 50, 75)), median_interval(differences)
    line = (f"  {front} vs {direct}, one request at a time, alternated ({len(differences)} rounds): TTFT {ttft[1]:+.2f} ms "
            f"(median within {interval[0]:+.2f} to {interval[1]:+.2f} at 95%; quartiles {ttft[0]:+.2f} to {ttft[2]:+.2f})")
    if token:
        q = np.percentile(token, (25, 50, 75))
        line += f", per token {q[1]:+.3f} ms ({q[0]:+.3f} to {q[2]:+.3f})"
    idle, _ = _differences(rounds, front, direct, "idle_ttft_ms")
    if idle:
        low, high = median_interval(idle)
        line += f"; after idling, TTFT {np.median(idle):+.2f} ms ({low:+.2f} to {high:+.2f})"
    return line


def summary(rows: list[Level], ceilings: list[CeilingRound]) -> list[str]:
    """The comparisons printed after the rows, then the front's ceiling from `ceilings`, then each front against
    its targets."""
    rounds = [r for r in rows if r.round is not None]
    rows = [r for r in rows if r.round is None and r.client == "python"]
    by = {(r.path, r.streams): r for r in rows}
    lines = []
    for front, direct in (("ensemble", DIRECT), ("tensorrt_llm_bls", DIRECT), (COALESCED, DIRECT),
                          ("aggregated", ENGINE_DIRECT)):
        one_f, one_d = by.get((front, 1)), by.get((direct, 1))
        if one_f and one_d:
            lines.append(f"  {front} vs {direct}, 1 stream: TTFT {one_f.ttft_ms - one_d.ttft_ms:+.2f} ms, per token "
                         f"{one_f.token_ms - one_d.token_ms:+.3f} ms, gap between responses {one_f.gap_ms - one_d.gap_ms:+.3f} ms "
                         f"({one_f.completed} and {one_d.completed} requests)")
        ratios = [f"{s}: {by[(front, s)].tokens_per_s / by[(direct, s)].tokens_per_s:.2f}"
                  for s in sorted({r.streams for r in rows}) if (front, s) in by and (direct, s) in by]
        if ratios:
            lines.append(f"  {front} / {direct} tokens/s by streams: " + ", ".join(ratios))
        paired = _paired(rounds, front, direct)
        if paired:
            lines.append(paired)
    for front, direct in ((FLOOR, DIRECT), ("tensorrt_llm_bls", FLOOR), (COALESCED, "tensorrt_llm_bls")):
        paired = _paired(rounds, front, direct)
        if paired:
            lines.append(paired)
    top = max(r.streams for r in rows)
    lines.append(f"  CPU ms per output token by process, {top} streams (2+ cores busy means the machine, not the engine, is the limit):")
    for r in (r for r in rows if r.streams == top):
        shown = shares(r.cpu_ms_per_token)
        lines.append(f"    {r.path:<27} total {sum(ms for _, ms in shown):.2f}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in shown))
    if ceilings:
        lines += _ceiling(ceilings)
    return lines + against_targets(rounds, ceilings)


def _bound(ceilings: list[CeilingRound]) -> str | None:
    """The ceiling rounds' path without a front: the engines called directly."""
    return next((b for b in BOUNDS if ceilings and b in ceilings[0].fronts), None)


def _clients(ceilings: list[CeilingRound]) -> str:
    """What drove the ceiling rounds' paths."""
    return ", ".join(sorted({level.client for c in ceilings for level in c.fronts.values()}))


def _ceiling(ceilings: list[CeilingRound]) -> list[str]:
    """The engine's peak by round, then each path's tokens/s against it."""
    engine = [max(c.engine.values()) for c in ceilings]
    timed = ceilings[0].fronts
    lines = [f"  the {ENGINE}'s best tokens/s by round (bench-100mb, batch {' or '.join(map(str, CEILING_BATCHES))}): "
             + ", ".join(f"{rate:.0f}" for rate in engine)
             + f"; the paths' load driven by {_clients(ceilings)}"]
    bound = _bound(ceilings)
    for front in ordered(timed):
        ratios = [c.ratio(front) for c in ceilings]
        served = [c.fronts[front].tokens_per_s for c in ceilings]
        what, who = ("without a front", "") if front in BOUNDS else ("front ceiling", "the front ")
        line = (f"  {what} ({front}, {timed[front].streams} streams) / the {ENGINE}'s best, "
                f"{len(ceilings)} rounds: median {np.median(ratios):.2f}x ({min(ratios):.2f}x to {max(ratios):.2f}x; "
                f"by round {', '.join(f'{r:.2f}x' for r in ratios)}), {who}serving "
                f"{np.median(served):.0f} tokens/s (median); {sum(r >= CEILING_TARGET for r in ratios)} of {len(ratios)} rounds at "
                f"{CEILING_TARGET:g}x or more")
        if who and bound:
            shares_of_direct = [c.fronts[front].tokens_per_s / c.fronts[bound].tokens_per_s for c in ceilings]
            line += f"; {np.median(shares_of_direct):.2f} of the engines called directly ({bound}) in the same round (median)"
        lines.append(line)
    return lines


def against_targets(rounds: list[Level], ceilings: list[CeilingRound]) -> list[str]:
    """Each text front against the three targets, a line each, then what bounds them on this machine:
    front_floor's TTFT (the least one Python model and one engine hop add) and the engines called directly in
    the ceiling rounds, prefill + decode or aggregated_engine (no front spending CPU on the same cores serves
    more)."""
    def verdict(met: bool) -> str:
        return "met" if met else "not met"

    def against(differences: list[float], target: float, digits: int) -> str:
        """The median against `target`, and whether its 95% interval lies on the same side: with one stream's
        rounds spread over milliseconds here, a median just under the target may not be."""
        added, (low, high) = np.median(differences), median_interval(differences)
        if high <= target or low > target:
            return f"{added:+.{digits}f} ms ({verdict(added <= target)})"
        return (f"{added:+.{digits}f} ms ({verdict(added <= target)} by the median; its 95% interval "
                f"{low:+.{digits}f} to {high:+.{digits}f} holds the target)")

    lines = []
    for front in (*FRONTS, COALESCED):
        ttft, token = _differences(rounds, front, DIRECT)
        parts = []
        if ttft:
            parts.append(f"TTFT {against(ttft, TTFT_TARGET_MS, 2)}")
        if token:
            parts.append(f"per token {against(token, TOKEN_TARGET_MS, 3)}")
        if ceilings and front in ceilings[0].fronts:
            at = sum(c.ratio(front) >= CEILING_TARGET for c in ceilings)
            parts.append(f"ceiling at {CEILING_TARGET:g}x in {at} of {len(ceilings)} rounds ({verdict(at == len(ceilings))})")
        if parts:
            lines.append(f"    {front:<27} " + "; ".join(parts))
    if not lines:
        return []
    bounds = []
    floor, _ = _differences(rounds, FLOOR, DIRECT)
    if floor:
        idle, _ = _differences(rounds, FLOOR, DIRECT, "idle_ttft_ms")
        bounds.append(f"{FLOOR} adds {np.median(floor):+.2f} ms of TTFT" + (f" ({np.median(idle):+.2f} after idling)" if idle else ""))
    if ceilings and (bound := _bound(ceilings)):
        ratios = [c.ratio(bound) for c in ceilings]
        bounds.append(f"the engines called directly ({bound}) serve {min(ratios):.2f}x to {max(ratios):.2f}x the {ENGINE}'s peak")
    header = (f"  against the targets (one request at a time after one on the same path, the medians of the alternated rounds against {DIRECT}: TTFT added "
              f"<= {TTFT_TARGET_MS:g} ms, per token <= {TOKEN_TARGET_MS:g} ms; every ceiling round at {CEILING_TARGET:g}x or more):")
    return [header, *lines, *([f"  bounds on this machine: {'; '.join(bounds)}"] if bounds else [])]


def figure(rows: list[Level], ceilings: list[CeilingRound]) -> FrontFigure:
    """What the run's figure shows: the levels' tokens/s per path, the ceiling rounds, and each path's
    TTFT added in the alternated rounds."""
    tokens: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.round is None and r.client == "python":
            tokens.setdefault(r.path, []).append((r.streams, r.tokens_per_s))
    rounds = [r for r in rows if r.round is not None]
    fronts = ordered(ceilings[0].fronts) if ceilings else []
    return FrontFigure(
        tokens=tokens,
        engine_peaks=[max(c.engine.values()) for c in ceilings],
        ratios={front: [c.ratio(front) for c in ceilings] for front in fronts},
        ttft_added={path: _differences(rounds, path, DIRECT)[0] for path in (*FRONTS, COALESCED, FLOOR)},
        ceiling_target=CEILING_TARGET, ttft_target_ms=TTFT_TARGET_MS,
        ceiling_client=_clients(ceilings))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench front", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-tiny.yaml"))
    p.add_argument("--out", type=Path, default=Path("build/front-bench"))
    p.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrent streams, comma-separated")
    p.add_argument("--seconds", type=float, default=5.0, help="measured window per path and level")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-requests", type=int, default=20,
                   help="a row's window lasts until this many requests sent in it have completed (at most 60 s)")
    p.add_argument("--ceiling-rounds", type=int, default=5,
                   help="rounds of the computing decode engine and each front at its best level in turn, for the ceiling")
    p.add_argument("--alternate", type=int, default=20,
                   help="then this many rounds of one request on each path in turn, for the one-stream comparison")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="each engine step takes this long without using the CPU, as on a GPU (default 0: as fast as it goes)")
    p.add_argument("--coalesce-backlog", type=int, default=0,
                   help="the orchestrators' coalesce_backlog (default 0: one token per response, as the spec's default)")
    p.add_argument("--coalesced-bls", type=int, default=2,
                   help=f"adds {COALESCED}, tensorrt_llm_bls with this coalesce_backlog, as a path and a front of the "
                        "ceiling rounds (0: not)")
    p.add_argument("--ceiling-client", choices=sorted(CEILING_PATHS), default="perf_analyzer",
                   help="what drives the ceiling rounds: perf_analyzer (default; tools/install_perf_analyzer.sh), whose "
                        f"bound is {ENGINE_DIRECT} called directly, or this bench's Python client, whose bound is {DIRECT}")
    p.add_argument("--trace", action="store_true",
                   help="Triton traces the alternated rounds' requests, and where each first token's time goes is printed "
                        "per path, segment by segment, and saved to <out>/first_token.json")
    args = p.parse_args(argv)
    if args.trace and not args.alternate:
        p.error("--trace traces the alternated rounds: give --alternate 1 or more")
    levels = tuple(int(x) for x in args.levels.split(","))
    step = f"{args.step_ms:g} ms per engine step" if args.step_ms else "engine steps as fast as they go"
    if args.coalesce_backlog:
        step += f"; orchestrators coalesce once {args.coalesce_backlog} responses wait"
    print(f"front cost with engine compute skipped ({step}; {args.max_tokens} tokens per request, {args.seconds:g} s per row "
          f"or until {args.min_requests} requests have completed; "
          "ms: TTFT p50, p50 of each request's mean gap between token responses and of its time per token after the first)")
    print(f"  {'path':<27}{'streams':>8}{'tokens/s':>11}{'TTFT ms':>10}{'gap ms':>9}{'ms/token':>11}{'requests':>10}{'errors':>8}")
    rows, ceilings = measure(args.config, args.out, levels, args.seconds, args.max_tokens, args.step_ms, args.coalesce_backlog,
                             min_requests=args.min_requests, alternate=args.alternate, ceiling_rounds=args.ceiling_rounds,
                             engine_peak=lambda: engine_ceiling(Path("build"), CEILING_BATCHES), coalesced_bls=args.coalesced_bls,
                             ceiling_client=args.ceiling_client, trace=args.trace)
    for line in summary(rows, ceilings):
        print(line)
    saved = args.out / "front.json"
    saved.write_text(json.dumps({"step_ms": args.step_ms, "max_tokens": args.max_tokens,
                                 "ceiling_rounds": [asdict(c) for c in ceilings],
                                 "rows": [asdict(r) for r in rows if r.round is None and r.client == "python"],
                                 "perf_analyzer_rows": [asdict(r) for r in rows if r.client == "perf_analyzer"],
                                 "alternated": [asdict(r) for r in rows if r.round is not None]}, indent=1))
    print(f"  rows saved to {saved} (for `python -m loadtest plan --front`)")
    drawn = plot(figure(rows, ceilings), args.out / "front.png")
    if drawn:
        print(f"  figure: {drawn}")
    return 0
