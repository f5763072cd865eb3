"""`python -m loadtest soak --duration 300`: steady streaming load with faults injected on a schedule.

Builds cpu-tiny and serves it with `disagg-serve` on free loopback ports, as a user would. Client threads
stream requests to `ensemble` and `aggregated` without pause; some are cancelled after a few tokens, and
one in ten is a request from the bad-input catalog (loadtest/bad_inputs.py). Faults, at fixed fractions
of the run: `kill -9` of the decode stub, `kill -9` of the prefill stub, the decode stub stopped
(SIGSTOP) for `--pause` seconds and resumed. Every request has a deadline; one that passes it without an
answer is hung. Prints and writes (`--out`, JSON): requests completed, failed with an error, cancelled,
hung (must be 0), ended early without an error (must be 0); each bad input not refused with its own
error, when and with what (those that met no engine outage: must be 0); for each fault the seconds until the
deployment served again, and whether an engine's tritonserver had to be started again meanwhile; KV
blocks and handoffs held at the end (must be 0); shared-memory objects of the deployment after the stop (must be 0);
restarts of the main server, which runs the ensembles and orchestrators (must be 0); and restarts of the
tritonservers that run one engine model each (disagg-serve's isolation: a stub killed at the wrong moment
can abort the server running it, then that engine's server is restarted). Exit code 1 if any must-be-0
figure is not.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from disagg.engine.sampling import NO_END_ID
from disagg.serve.leftovers import deployment_objects
from disagg.serve.metrics import by_role, scrape
from disagg.serve.server import free_ports
from disagg.triton.credential import internal_key
from disagg.triton.load_board import board_key
from loadtest.bad_inputs import CATALOG, send
from tools.stream_client import build_inputs, end_stream, stream

PROMPTS = ["Call me Ishmael.", "It was the best of times", "In the beginning", "The quick brown fox", "Unicode: café ✓"]
REQUEST_DEADLINE_S = 30.0
FAULTS = ((0.2, "kill -9 decode"), (0.45, "kill -9 prefill"), (0.7, "pause decode"))
# What a request meets while an engine it needs is down (the orchestrator's HopErrors with engine_away, a
# direct engine call's broken connection, or Triton's own answer to a call to an engine model whose stub died or
# that is being reloaded): a bad input sent then is refused for that instead, as upstream, whose engine does the
# checking, would refuse it too.
OUTAGE = ("no live engine instance", "died while serving this request", "no replica is serving", "Stream removed",
          "Socket closed", "failed to connect", "Connection refused", "is not healthy", "has no available versions")


@dataclass
class Report:
    duration_s: float
    outcomes: dict[str, int] = field(default_factory=dict)  # completed / error / cancelled / hung / truncated / bad_input_refused
    errors: dict[str, int] = field(default_factory=dict)  # first 80 characters of each error text -> count
    hung: list[dict] = field(default_factory=list)  # {"sent_at_s", "model", "cancelled", "outcome"} of each hung or truncated request
    misanswered: list[dict] = field(default_factory=list)  # {"sent_at_s", "bad_input", "got"} of each bad input refused otherwise
    faults: list[dict] = field(default_factory=list)  # {"fault", "at_s", "served_again_after_s", "engine_server_restarted"}
    kv_blocks_in_use: dict[str, float] = field(default_factory=dict)
    handoffs_held: float = 0.0
    shm_leftovers: list[str] = field(default_factory=list)
    server_restarts: int = 0  # of the main server (ensembles, orchestrators)
    engine_server_restarts: int = 0  # of the servers running one engine model each: part of healing
    engine_restarts: dict[str, int] = field(default_factory=dict)

    def failures(self) -> list[str]:
        bad = []
        if self.outcomes.get("hung"):
            bad.append(f"{self.outcomes['hung']} requests hung")
        if self.outcomes.get("truncated"):
            bad.append(f"{self.outcomes['truncated']} answers ended early without an error")
        if any(self.kv_blocks_in_use.values()) or self.handoffs_held:
            bad.append(f"KV held at the end: {self.kv_blocks_in_use}, handoffs {self.handoffs_held}")
        if self.shm_leftovers:
            bad.append(f"shared memory left after the stop: {self.shm_leftovers}")
        if self.server_restarts:
            bad.append(f"the server restarted {self.server_restarts} times")
        if any(f["served_again_after_s"] is None for f in self.faults):
            bad.append("a fault after which the deployment never served again")
        if wrong := [m for m in self.misanswered if not any(o in m["got"] for o in OUTAGE)]:
            bad.append(f"{len(wrong)} bad inputs answered with neither their refusal nor an engine outage: {wrong[:3]}")
        return bad


class Deployment:
    """disagg-serve on free loopback ports, with `extra` arguments."""

    def __init__(self, repo: Path, log: Path, extra: tuple[str, ...] = ()):
        self.repo = repo
        self.http, self.grpc, self.metrics, self.api = free_ports(4)
        self.key = board_key(repo)
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "disagg-serve"), "--model-repository", str(repo), "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics), "--openai-port", str(self.api), *extra],
            stdout=open(log, "w"), stderr=subprocess.STDOUT,
        )
        self.log = log
        deadline = time.monotonic() + 300
        while "disagg-serve: ready" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"disagg-serve did not become ready:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    @property
    def engine_urls(self) -> dict[str, str]:
        """{engine model: gRPC URL of the tritonserver running it}, as disagg-serve printed them."""
        found = re.findall(r"^disagg-serve: engine model (\S+) in its own tritonserver on (\S+): gRPC :(\d+)", self.log.read_text(), re.M)
        return {model: f"{host}:{port}" for model, host, port in found}

    def main_pid(self) -> int:
        """The main tritonserver's process (disagg-serve runs the engines' servers beside it)."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", f"tritonserver .*--http-port={self.http} "],
                             capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else 0

    def server_restarts(self, engines: bool = False) -> int:
        """Restarts disagg-serve logged of the main server, or (`engines`) of the engines' servers."""
        prefix = "disagg-serve: tritonserver of " if engines else "disagg-serve: tritonserver exited with code "
        return sum(1 for line in self.log.read_text().splitlines() if line.startswith(prefix) and " exited with code " in line)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    @property
    def metrics_url(self) -> str:
        """Every server's metrics, merged by the API."""
        return f"http://127.0.0.1:{self.api}/metrics"

    def stub(self, instance: str) -> int:
        out = subprocess.run(["pgrep", "-f", f"triton_python_backend_stub.*{instance}"], capture_output=True, text=True).stdout.split()
        return int(out[0]) if out else 0

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _cancelled_stream(url: str, model: str, prompt: str, after: int) -> str:
    """Streams a long request and cancels it after `after` responses: 'cancelled'; 'error: ...'; 'truncated'
    when the answer ended, without an error, before that (200 tokens were asked for and no token ends it);
    'hung' when a response takes longer than REQUEST_DEADLINE_S."""
    client = grpcclient.InferenceServerClient(url)
    got: queue.Queue = queue.Queue()
    ended = False  # by the server: then nothing is left to cancel
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer(model, build_inputs(prompt, 200, end_id=NO_END_ID), enable_empty_final_response=True)
        for _ in range(after):
            result, error = got.get(timeout=REQUEST_DEADLINE_S)
            if error is not None:
                ended = True
                return f"error: {error.message()}"
            if result.get_response().parameters["triton_final_response"].bool_param:
                ended = True
                return "truncated"
        return "cancelled"
    except InferenceServerException as exc:  # e.g. the stream broke before the request was sent
        return f"error: {exc.message()}"
    except queue.Empty:
        return "hung"
    finally:
        end_stream(client, ended)


def _client(dep: Deployment, seed: int, stop: threading.Event, outcomes: Counter, errors: Counter, hung: list,
            misanswered: list, lock: threading.Lock, started: float) -> None:
    rng = random.Random(seed)
    key, engines = internal_key(dep.key), dep.engine_urls
    while not stop.is_set():
        sent = time.monotonic()
        roll = rng.random()
        model = rng.choice(["ensemble", "ensemble", "aggregated"])
        prompt = f"{rng.choice(PROMPTS)} {rng.randrange(1000)}"
        if roll < 0.1:
            bad = rng.choice([b for b in CATALOG if "MB" not in b.name])  # the big ones would dominate the run
            try:
                send(bad, dep.http_url, dep.grpc_url, key, engines)
                outcome = "bad_input_refused"
            except AssertionError as exc:
                outcome, message = "error", f"bad input answered otherwise: {exc}"
                with lock:
                    misanswered.append({"sent_at_s": round(sent - started, 1), "bad_input": bad.name, "got": str(exc)[:400]})
            except Exception as exc:  # noqa: BLE001 - e.g. the server unreachable for a moment
                outcome, message = "error", str(exc)
        elif roll < 0.3:
            result = _cancelled_stream(dep.grpc_url, model, prompt, rng.randint(1, 4))
            outcome, message = ("error", result[7:]) if result.startswith("error") else (result, "")
        else:
            try:
                stream(dep.grpc_url, model, prompt, rng.randint(16, 96), end_id=NO_END_ID, timeout_s=REQUEST_DEADLINE_S)
                outcome = "completed"
            except TimeoutError:
                outcome = "hung"
            except Exception as exc:  # noqa: BLE001 - counted with its message
                outcome, message = "error", str(exc)
        with lock:
            outcomes[outcome] += 1
            if outcome == "error":
                errors[message[:80]] += 1
            if outcome in ("hung", "truncated"):
                hung.append({"sent_at_s": round(sent - started, 1), "model": model, "cancelled": 0.1 <= roll < 0.3, "outcome": outcome})


def _served_again(dep: Deployment, since: float, limit_s: float = 30.0) -> float | None:
    while time.monotonic() - since < limit_s:
        try:
            if stream(dep.grpc_url, "ensemble", "probe", 4, timeout_s=5).text is not None:
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - not yet
            time.sleep(0.1)
    return None


def _resume_later(pid: int, pause_s: float) -> None:
    time.sleep(pause_s)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # the watchdog ended it


def _inject(dep: Deployment, fault: str, pause_s: float) -> threading.Thread | None:
    """Injects `fault`; a pause resumes on the returned thread, so recovery is timed from the stop."""
    instance = "prefill_0_0" if "prefill" in fault else "decode_0_0"
    pid = dep.stub(instance)
    if not pid:
        raise RuntimeError(f"no stub process for {instance}")
    if fault.startswith("kill"):
        os.kill(pid, signal.SIGKILL)
        return None
    os.kill(pid, signal.SIGSTOP)
    resume = threading.Thread(target=_resume_later, args=(pid, pause_s), daemon=True)
    resume.start()
    return resume


def run(repo: Path, duration_s: float, clients: int, pause_s: float, log: Path) -> Report:
    report = Report(duration_s)
    dep = Deployment(repo, log)
    stop, lock = threading.Event(), threading.Lock()
    outcomes, errors = Counter(), Counter()
    started = time.monotonic()
    threads = [threading.Thread(target=_client, args=(dep, i, stop, outcomes, errors, report.hung, report.misanswered, lock, started), daemon=True)
               for i in range(clients)]
    try:
        for t in threads:
            t.start()
        for at, fault in FAULTS:
            time.sleep(max(0.0, started + at * duration_s - time.monotonic()))
            restarts, injected = dep.server_restarts(engines=True), time.monotonic()
            resume = _inject(dep, fault, pause_s)
            report.faults.append({"fault": fault, "at_s": round(injected - started, 1),
                                  "served_again_after_s": _served_again(dep, injected),
                                  "engine_server_restarted": dep.server_restarts(engines=True) > restarts})
            if resume:
                resume.join()
            print(f"soak: {fault} at {injected - started:.0f} s; served again after {report.faults[-1]['served_again_after_s']} s", flush=True)
        time.sleep(max(0.0, started + duration_s - time.monotonic()))
    finally:
        stop.set()
        for t in threads:
            t.join(REQUEST_DEADLINE_S + 10)
    report.outcomes, report.errors = dict(outcomes), dict(errors.most_common(12))
    deadline = time.monotonic() + 15
    while True:  # in-flight cleanup (stops, drains) settles within seconds
        metrics = by_role(scrape(dep.metrics_url))
        report.kv_blocks_in_use = metrics.get("disagg_kv_blocks_in_use", {})
        report.handoffs_held = sum(metrics.get("disagg_kv_handoff_held", {}).values())
        if (not any(report.kv_blocks_in_use.values()) and not report.handoffs_held) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report.engine_restarts = {r: int(v) for r, v in metrics.get("disagg_engine_restarts", {}).items()}
    report.server_restarts = dep.server_restarts()
    report.engine_server_restarts = dep.server_restarts(engines=True)
    dep.stop()
    report.shm_leftovers = [p.name for p in deployment_objects(dep.key)]
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest soak", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--clients", type=int, default=4, help="concurrent client threads (default 4)")
    p.add_argument("--pause", type=float, default=5.0, help="seconds the decode stub stays stopped (default 5)")
    p.add_argument("--config", default="configs/cpu-tiny.yaml")
    p.add_argument("--out", type=Path, default=Path("build/soak.json"))
    args = p.parse_args(argv)
    from disagg.cli import build
    from disagg.spec import load_spec

    spec = load_spec(args.config)
    build(spec, log=lambda _msg: None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = run(Path(spec.model_repository).resolve(), args.duration, args.clients, args.pause, args.out.with_suffix(".log"))
    args.out.write_text(json.dumps(asdict(report), indent=2))
    print(json.dumps(asdict(report), indent=2))
    failures = report.failures()
    print("soak: " + ("; ".join(failures) if failures else "every must-be-0 figure is 0"), flush=True)
    return 1 if failures else 0
