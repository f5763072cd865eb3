"""Where a first token's time goes, read from Triton's own request traces and the client's times.

`python -m disagg.bench front --trace` starts tritonserver with Triton's trace mode on file and every model's
level OFF, turns TIMESTAMPS on for the alternated rounds (`switch`), and reads the file the server writes as
it exits (`read`). Triton 2.51 stamps (server src/tracer.cc, src/grpc/stream_infer_handler.cc,
src/http_server.cc): a request read off a gRPC stream (GRPC_WAITREAD_END), taken by the model's instance
(COMPUTE_START), its first response handed back to the frontend (INFER_RESPONSE_COMPLETE, once per request on
a gRPC stream, per response over HTTP) and each response's write to the client begun (GRPC_SEND_START; the
GRPC_SEND_END after it comes when gRPC's completion queue reports the write, at times after the client already
has the response). A request received over HTTP, as the fronts' hops to prefill are, starts at
HTTP_RECV_START. Nothing of ours is instrumented: the front's own share is the time between two of Triton's
stamps.

The Python backend (python_backend r24.10, src/python_be.cc `ProcessRequests`) reports COMPUTE_START before it
copies a request into shared memory and COMPUTE_INPUT_END once it has, as it signals the stub.

The bench's client times its requests on the same clock as Triton's stamps (CLOCK_MONOTONIC: Python's
perf_counter, C++'s steady_clock), so the segments add up to the TTFT it saw. A front's first token, in nine
segments (a path that calls prefill directly has only the first two, the engine's and the last two):

    client to server   the client's send -> the server has read the request off the gRPC stream
    server in          -> the front model's instance has it (Triton's queue)
    into the stub      -> the Python backend has copied it into shared memory for the stub
    stub, to its hop   -> the hop's request read by the engine server's HTTP frontend: the stub woken, its
                       execute (inputs, validating, tokenizing, routing), the connect and the send
    hop in             -> prefill's instance has it (HTTP parsing, Triton's queue, the Python backend)
    engine             -> prefill's first response back at its frontend (the engine's step)
    answer back        -> the front's first response at its own frontend: the HTTP answer written and read,
                       parsed, detokenized, and sent through the Python backend
    server out         -> its write to the client's stream begins
    server to client   -> the client's callback has it (the write, the client's gRPC)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ENGINE = "prefill"  # the engine every front's first hop reaches, and the direct path's first request
SEGMENTS = ("client to server", "server in", "into the stub", "stub, to its hop", "hop in", "engine", "answer back", "server out",
            "server to client")
SERVER = SEGMENTS[1:-1]  # the segments inside the server


def server_args(trace_file: Path) -> list[str]:
    """tritonserver's arguments for traces written to `trace_file` at its exit, none taken until `switch`."""
    return [f"--trace-config=triton,file={trace_file}", "--trace-config=level=OFF", "--trace-config=rate=1",
            "--trace-config=count=-1"]


def switch(client, models: list[str], on: bool) -> None:
    """Every request of `models` traced with timestamps (on), or none (off); `client` is tritonclient's."""
    for model in models:
        client.update_trace_settings(model_name=model, settings={"trace_level": ["TIMESTAMPS" if on else "OFF"],
                                                                 "trace_rate": "1"})


@dataclass
class Trace:
    """One request as Triton traced it: its model, its id, and each activity's timestamps (ns, in order)."""

    model: str
    request_id: str
    stamps: dict[str, list[int]]

    def at(self, name: str) -> int | None:
        times = self.stamps.get(name)
        return times[0] if times else None

    def after(self, name: str, t: int) -> int | None:
        return next((s for s in self.stamps.get(name, []) if s >= t), None)


def read(trace_file: Path) -> list[Trace]:
    """The traces of a file Triton wrote: an array of records, each a trace's identity (id, model_name,
    request_id) or a batch of its timestamps (id, timestamps)."""
    models: dict[int, tuple[str, str]] = {}
    stamps: dict[int, dict[str, list[int]]] = {}
    for record in json.loads(trace_file.read_text()):
        if "model_name" in record:
            models[record["id"]] = (record["model_name"], str(record.get("request_id", "")))
        for stamp in record.get("timestamps", []):
            if stamp["ns"]:  # Triton writes 0 for a stamp it never took (HTTP_SEND_* of a streamed answer)
                stamps.setdefault(record["id"], {}).setdefault(stamp["name"], []).append(stamp["ns"])
    for times in stamps.values():
        for series in times.values():
            series.sort()
    return [Trace(model, request_id, stamps.get(i, {})) for i, (model, request_id) in models.items()]


def _ms(start: int | None, end: int | None) -> float | None:
    return None if start is None or end is None or end < start else (end - start) / 1e6


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _around(trace: Trace, client: tuple[float, float], inside: dict[str, float | None]) -> dict[str, float] | None:
    """`inside` (from the instance having the request to its first response back at the frontend) between the
    segments every path has: the client's send to the instance, the first response to the client's callback.
    `client`: when the client sent the request and had its first token (seconds). None if a stamp is missing."""
    read_at, start, first = trace.at("GRPC_WAITREAD_END"), trace.at("COMPUTE_START"), trace.at("INFER_RESPONSE_COMPLETE")
    written = None if first is None else trace.after("GRPC_SEND_START", first)
    segments = {"client to server": _ms(_ns(client[0]), read_at), "server in": _ms(read_at, start), **inside,
                "server out": _ms(first, written), "server to client": _ms(written, _ns(client[1]))}
    return None if None in segments.values() else segments


def direct_timeline(trace: Trace, client: tuple[float, float]) -> dict[str, float] | None:
    """The segments of a request sent to the engine by the client itself."""
    return _around(trace, client, {"engine": _ms(trace.at("COMPUTE_START"), trace.at("INFER_RESPONSE_COMPLETE"))})


def front_timeline(front: Trace, hops: list[Trace], client: tuple[float, float]) -> dict[str, float] | None:
    """The segments of a request to a front model, whose hop is the first of `hops` (prefill's requests received
    over HTTP) that arrived while the front held it: one request at a time, there is no other."""
    start, first = front.at("COMPUTE_START"), front.at("INFER_RESPONSE_COMPLETE")
    if None in (start, first):
        return None
    hop = min((h for h in hops if start <= (h.at("HTTP_RECV_START") or 0) <= first), key=lambda h: h.at("HTTP_RECV_START"),
              default=None)
    if hop is None:
        return None
    received, hop_start, hop_first = hop.at("HTTP_RECV_START"), hop.at("COMPUTE_START"), hop.at("INFER_RESPONSE_COMPLETE")
    handed = front.at("COMPUTE_INPUT_END")
    return _around(front, client, {"into the stub": _ms(start, handed), "stub, to its hop": _ms(handed, received),
                                   "hop in": _ms(received, hop_start), "engine": _ms(hop_start, hop_first),
                                   "answer back": _ms(hop_first, first)})


def timelines(traces: list[Trace], paths: dict[str, str], measured: dict[str, tuple[float, float]]) -> dict[str, list[dict[str, float]]]:
    """{path: its measured requests' segments}. `paths` maps each traced front model (or ENGINE, for the direct
    path) to the path it serves; `measured`: the client's requests to count (not warm-ups), by id, each with
    when it was sent and its first token came."""
    hops = [t for t in traces if t.model == ENGINE and "HTTP_RECV_START" in t.stamps]
    found: dict[str, list[dict[str, float]]] = {}
    for trace in traces:
        if trace.request_id not in measured or trace.model not in paths:
            continue
        client = measured[trace.request_id]
        segments = direct_timeline(trace, client) if trace.model == ENGINE else front_timeline(trace, hops, client)
        if segments is not None:
            found.setdefault(paths[trace.model], []).append(segments)
    return found


def table(found: dict[str, list[dict[str, float]]], direct: str) -> list[str]:
    """p50 of each segment per path, then of the server's share (the segments inside it) and of the whole (the
    TTFT the client saw), each against the direct path's."""
    if not found:
        return []
    header = "".join(f"{s:>18}" for s in (*SEGMENTS, "in the server", "TTFT"))
    lines = ["  where the first token's time goes (Triton's request traces of the alternated rounds, the client's times; "
             "p50 ms per segment, then of the server's part and of the whole, with what each adds to the direct path's):",
             f"    {'path':<28}{'requests':>9}{header}"]
    sums = {path: (float(np.median([sum(s[n] for n in SERVER if n in s) for s in segments])),
                   float(np.median([sum(s.values()) for s in segments]))) for path, segments in found.items()}
    for path, segments in sorted(found.items(), key=lambda item: sums[item[0]][1]):
        cells = "".join(f"{np.median([s[name] for s in segments]):>18.3f}" if name in segments[0] else f"{'-':>18}"
                        for name in SEGMENTS)
        for i, total in enumerate(sums[path]):
            added = f" ({total - sums[direct][i]:+.3f})" if direct in sums and path != direct else ""
            cells += f"{f'{total:.3f}{added}':>18}"
        lines.append(f"    {path:<28}{len(segments):>9}{cells}")
    return lines
