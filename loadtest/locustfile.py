"""Locust user streaming from a Triton ensemble over HTTP `generate_stream` (server-sent events).

    PYTHONPATH=. locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 -u 64 -r 64 \\
        --model ensemble --workload mixed --request-rate 8 \\
        --tokenizer build/checkpoints/tiny-llama/tokenizer.json --json-file results/ensemble-8rps
    # samples: results/ensemble-8rps.samples.jsonl (next to --json-file, else --csv; else a new temp dir)

HTTP through geventhttpclient (FastHttpUser), not tritonclient gRPC: gRPC's threads under gevent hung
Locust at shutdown (docs/triton-on-cpu.md). Per request it keeps raw perf_counter stamps of every
streamed response and appends one JSON line to the samples file (loadtest/samples.py defines TTFT, ITL,
TPOT and E2E from them); reports are computed from those lines with exact percentiles, not from
Locust's bucketed ones. The samples file is `--samples-out` when given; otherwise `<prefix>.samples.jsonl`
beside the run's own `--json-file`/`--csv` output, or `samples.jsonl` in a new temporary directory, so a
run never writes into the working directory unasked. Its path is printed (stderr) when the run starts.

Prompt lengths are counted as the server's preprocessing counts them; pass `--add-special-tokens false`
for a deployment whose spec sets `model.add_special_tokens: false`.

Locust sees one request per stream (response_time = E2E ms, response_length = output tokens). TTFT and
TPOT rows (type METRIC) are logged straight into their stats entries, not through `events.request`,
so the Aggregated row and RPS count real streams only.

The workload (loadtest/workload.py) fixes the requests and, with a rate, their Poisson send times; a
run stops by itself after `max_requests` requests or `duration_s` seconds (in-flight streams finish),
and Locust's `--run-time` (default: duration_s + 30 s) is the hard bound. Single process only: the
request plan and the samples file are per process.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import replace

import gevent
from gevent import GreenletExit
from locust import FastHttpUser, events, task
from locust.exception import StopUser

from loadtest.samples import DEPLOYMENTS, Sample, samples_path
from loadtest.workload import Request, load_workload

DRAIN_S = 30.0  # hard-bound slack after duration_s for in-flight streams, when --run-time is not given
LATE_S = 0.1  # open loop: a request sent this much after its planned time means the users were all busy

log = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def _options(parser) -> None:
    parser.add_argument("--model", choices=sorted(DEPLOYMENTS), default="ensemble",
                        help="ensemble (disaggregated) or aggregated (baseline)")
    parser.add_argument("--workload", default="mixed", help="workload YAML path, or a name in loadtest/workloads/")
    parser.add_argument("--tokenizer", default="build/checkpoints/tiny-llama/tokenizer.json",
                        help="tokenizer.json of the served model (prompt lengths are in its tokens)")
    parser.add_argument("--samples-out", default=None,
                        help="JSONL file to append one line per request to (appends: remove it between runs); "
                             "default: <prefix>.samples.jsonl beside --json-file or --csv, else a new temp dir")
    parser.add_argument("--add-special-tokens", choices=("true", "false"), default="true",
                        help="count prompt tokens with the tokenizer's special tokens (BOS), as the served "
                             "preprocessing does; false for a spec with model.add_special_tokens: false")
    parser.add_argument("--request-rate", type=float, default=None,
                        help="override the workload's arrival rate (requests/s; 0: closed loop)")
    parser.add_argument("--max-requests", type=int, default=None, help="override the workload's max_requests")


class Plan:
    """One run's shared state: the requests to hand out, their arrival times, and the samples file."""

    def __init__(self, environment):
        opts = environment.parsed_options
        workload = load_workload(opts.workload)
        if opts.max_requests:
            workload = replace(workload, max_requests=opts.max_requests)
        if opts.request_rate is not None:
            workload = workload.with_rate(opts.request_rate or None)
        self.environment = environment
        self.workload = workload
        self.model = opts.model
        self.users = opts.num_users
        self.requests = workload.requests(opts.tokenizer, opts.add_special_tokens == "true")
        self.arrivals = workload.arrivals() if workload.rate else None
        self.samples_path = samples_path(opts.samples_out, opts.json_file or opts.csv_prefix)
        self.samples_path.parent.mkdir(parents=True, exist_ok=True)
        self.out = open(self.samples_path, "a", buffering=1)
        print(f"locustfile: samples -> {self.samples_path}", file=sys.stderr, flush=True)
        self.t0: float | None = None
        self.issued = 0
        self.done = 0
        self.warned_late = False
        if workload.rate and opts.num_users < workload.rate * 2:  # Little's law: users >= rate * E2E
            log.warning("open loop at %.2f req/s with %d users: streams longer than %.1f s will make sends "
                        "fall behind schedule; raise -u", workload.rate, opts.num_users, opts.num_users / workload.rate)
        if not opts.run_time:  # Locust's own bound is the hard one; give it one when none was given
            gevent.spawn_later(workload.duration_s + DRAIN_S, self.quit, "hard time bound reached")

    def exhausted(self) -> bool:
        """True once every request was handed out, or the next one falls after the run's duration."""
        i, duration = self.issued, self.workload.duration_s
        if i >= len(self.requests) or time.perf_counter() - self.t0 >= duration:
            return True
        return self.arrivals is not None and self.arrivals[i] >= duration

    def take(self) -> tuple[Request, float | None] | None:
        """The next request and its planned send time (s after start; None in a closed loop), or None
        when the plan is exhausted."""
        if self.t0 is None:
            self.t0 = time.perf_counter()
            gevent.spawn_later(self.workload.duration_s, self.maybe_quit)
        if self.exhausted():
            return None
        self.issued += 1
        return self.requests[self.issued - 1], (self.arrivals[self.issued - 1] if self.arrivals else None)

    def wait_until(self, scheduled: float, index: int) -> None:
        delay = self.t0 + scheduled - time.perf_counter()
        if delay > 0:
            gevent.sleep(delay)
        elif -delay > LATE_S and not self.warned_late:
            self.warned_late = True
            log.warning("open loop fell behind: request %d left %.2f s after its planned time, all %d users "
                        "were busy; raise -u", index, -delay, self.users)

    def record(self, sample: Sample) -> None:
        self.out.write(sample.to_json() + "\n")
        self.done += 1
        self.maybe_quit()

    def maybe_quit(self) -> None:
        """Stops the run once no request is left to send and none is in flight."""
        if self.done == self.issued and self.exhausted():
            self.quit(f"{self.done} requests done")

    def quit(self, why: str) -> None:
        log.info("stopping: %s", why)
        gevent.spawn(self.environment.runner.quit)  # not from this greenlet, which quit() may kill

    def close(self) -> None:
        self.out.close()


PLAN: Plan | None = None


@events.test_start.add_listener
def _start(environment, **_kwargs) -> None:
    global PLAN
    PLAN = Plan(environment)


@events.test_stop.add_listener
def _stop(environment, **_kwargs) -> None:
    if PLAN is not None:
        PLAN.close()


def _sse_error(body: bytes) -> str | None:
    """The server's message from an error response (`data: {"error": ...}`), if it has one."""
    for line in body.splitlines():
        if line.startswith(b"data:"):
            try:
                return json.loads(line[5:]).get("error")
            except ValueError:
                return None
    return None


def _token_count(value) -> int | None:
    """A response's `num_output_tokens` as Triton's generate endpoint writes it (a number, or a list of one);
    None where the model has no such output."""
    if value is None:
        return None
    return int(sum(value)) if isinstance(value, list) else int(value)


class TritonStreamUser(FastHttpUser):
    """Sends the plan's requests one at a time, each as a stream, and records its timeline."""

    network_timeout = 300.0  # longest wait for the next byte of a stream
    connection_timeout = 10.0

    @task
    def stream(self) -> None:
        job = PLAN.take()
        if job is None:
            raise StopUser()
        request, scheduled = job
        if scheduled is not None:
            PLAN.wait_until(scheduled, request.index)
        self.send(request, scheduled)

    def send(self, request: Request, scheduled: float | None) -> None:
        """Streams one request and records it. A stream cut off by the end of the run (Locust kills the
        greenlet) is recorded as an error too, so an overloaded run does not report only its survivors."""
        path = f"/v2/models/{PLAN.model}/generate_stream"
        body = {"text_input": request.prompt, "max_tokens": request.max_tokens, "stream": True}
        if PLAN.workload.exact_output_tokens:
            body["min_tokens"] = request.max_tokens
        t_chunks: list[float] = []
        chars: list[int] = []
        tokens: list[int | None] = []
        error, interrupted = None, None
        start_unix = time.time()
        t_send = time.perf_counter()
        with self.client.post(path, json=body, stream=True, catch_response=True, name=path) as resp:
            try:
                if resp.status_code != 200 or getattr(resp, "error", None):
                    error = _sse_error(resp.content or b"") or f"HTTP {resp.status_code}: {getattr(resp, 'error', '')}"
                else:
                    # NOTE: read line by line: the response's read(n) blocks until n bytes have arrived,
                    # which would merge chunks; Triton ends each SSE line with a bare "\n".
                    while line := resp._response.readline(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        at = time.perf_counter()
                        event = json.loads(line[5:])
                        if "error" in event:
                            error = event["error"]
                            break
                        t_chunks.append(at)
                        chars.append(len(event.get("text_output", "")))
                        tokens.append(_token_count(event.get("num_output_tokens")))
            except GreenletExit as exc:
                error, interrupted = "unfinished: the run stopped before the stream ended", exc
            except Exception as exc:  # noqa: BLE001 - any failure mid-stream is this request's error
                error = f"{type(exc).__name__}: {exc}"
            sample = Sample(
                model=PLAN.model, index=request.index, prompt_tokens=request.prompt_tokens,
                max_tokens=request.max_tokens, shared_prefix=request.shared_prefix, rate=PLAN.workload.rate,
                users=PLAN.users, scheduled=scheduled, start_unix=start_unix, t_send=t_send,
                t_chunks=tuple(t_chunks), chunk_chars=tuple(chars), t_end=time.perf_counter(), error=error,
                chunk_tokens=tuple(tokens) if None not in tokens else (),
            )
            resp.request_meta["response_time"] = sample.e2e * 1000
            resp.request_meta["response_length"] = sample.n_out
            if error is None:
                resp.success()
            else:
                resp.failure(error)
        stats = self.environment.stats
        if sample.ttft is not None:
            stats.get("time_to_first_token", "METRIC").log(sample.ttft * 1000, 0)
        if sample.tpot is not None:
            stats.get("time_per_output_token", "METRIC").log(sample.tpot * 1000, 0)
        PLAN.record(sample)
        if interrupted is not None:
            raise interrupted
