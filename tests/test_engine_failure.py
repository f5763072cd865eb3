"""A dying engine under `disagg-serve`, as an OOM kill or a driver fault would do it: requests on it fail
fast naming the hop, the watchdog brings it back (a stopped one too), /ready tells the truth meanwhile, a
hung server is killed and started again, and nothing is left in shared memory after a stop, even a
`kill -9` of the server.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from disagg.engine.sampling import NO_END_ID
from disagg.serve import watchdog
from disagg.serve.leftovers import deployment_objects
from disagg.serve.metrics import by_role, scrape
from disagg.triton.load_board import board_key, pid_alive
from loadtest.soak import Deployment
from tests.e2e_helpers import wait_kv_zero
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

NO_KV = {"prefill": 0, "decode": 0, "aggregated": 0}
HUNG_AFTER_S = 6.0  # disagg-serve's --hung-after-secs here (default 15): the hung-server test waits it out


class Served(Deployment):
    """`disagg-serve` on free loopback ports, as a user runs it (the soak's deployment), with probes."""

    def probe(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.api}{path}", timeout=2) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def stub_pid(self, instance: str) -> int:
        pid = self.stub(instance)
        assert pid, f"no stub process for {instance}"
        return pid

    def until(self, condition, timeout_s: float, what: str) -> float:
        """Seconds until `condition()` holds; fails naming `what` after timeout_s."""
        start = time.monotonic()
        while not condition():
            assert time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s"
            time.sleep(0.05)
        return time.monotonic() - start

    def serves(self) -> bool:
        try:
            return bool(stream(self.grpc_url, "ensemble", "Call me Ishmael.", 8, timeout_s=5).text)
        except Exception:  # noqa: BLE001 - not yet
            return False


@pytest.fixture(scope="module")
def served(cpu_tiny_project, tmp_path_factory):
    s = Served(cpu_tiny_project / "model_repository", tmp_path_factory.mktemp("serve") / "disagg-serve.log",
               ("--hung-after-secs", str(HUNG_AFTER_S)))
    yield s
    if s.proc.poll() is None:
        s.stop()


def _restarts(served) -> dict[str, float]:
    return by_role(scrape(served.metrics_url)).get("disagg_engine_restarts", {})


def test_a_killed_decode_fails_its_requests_within_2_s_and_heals_within_5_s(served):
    expected = {i: stream(served.grpc_url, "aggregated", f"prompt {i}", 250, end_id=NO_END_ID).text for i in range(4)}
    outcomes: dict[int, tuple[str, str, float]] = {}

    streaming = threading.Event()

    def one(i: int) -> None:
        try:
            text = stream(served.grpc_url, "ensemble", f"prompt {i}", 250, end_id=NO_END_ID, timeout_s=30,
                          on_text=lambda _t: streaming.set()).text
            outcomes[i] = ("ok", text, time.monotonic())
        except Exception as exc:  # noqa: BLE001 - what the client sees is the point
            outcomes[i] = ("error", str(exc), time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert streaming.wait(10)
    time.sleep(0.05)
    os.kill(served.stub_pid("decode_0_0"), signal.SIGKILL)
    killed = time.monotonic()
    not_ready = served.until(lambda: served.probe("/ready")[0] == 503, 2.0, "/ready turning false")
    assert served.probe("/live") == (200, {"live": True})  # healing, not dead
    for t in threads:
        t.join(30)
    errors = [(msg, at - killed) for kind, msg, at in outcomes.values() if kind == "error"]
    assert errors, "every stream finished before the kill: nothing was tested"
    for msg, after in errors:
        assert "decode: engine instance decode_0_0" in msg and "died while serving this request" in msg, msg
        assert after < 2.0, f"failed {after:.1f} s after the kill"
    assert all(text == expected[i] for i, (kind, text, _) in outcomes.items() if kind == "ok")
    healed = served.until(served.serves, 5.0 - (time.monotonic() - killed), "serving again within 5 s of the kill")
    healed = time.monotonic() - killed
    status, body = served.probe("/ready")
    assert status == 200 and body["engines"]["decode"]["alive"] == 1 and body["restarts"] == {"decode": 1}, body
    assert stream(served.grpc_url, "ensemble", "prompt 0", 250, end_id=NO_END_ID).text == expected[0]
    assert _restarts(served)["decode"] == 1
    assert wait_kv_zero(served, timeout_s=10.0) == NO_KV
    log = served.log.read_text()
    # reloaded by the watchdog, or (in about one kill of six) decode's own server aborted and was restarted: a
    # watchdog that finds that server down leaves it to its supervisor and logs nothing (disagg.serve.watchdog)
    assert ("decode: instance decode_0_0" in log and "reloaded in" in log) or "tritonserver of decode ready again" in log
    print(f"not ready after {not_ready:.2f} s, serving again {healed:.2f} s after the kill")


def test_a_killed_prefill_heals_and_its_kv_pool_is_replaced(served):
    key = board_key(served.repo)
    [pool] = Path("/dev/shm").glob(f"disagg_{key}_prefill_0_0_*")
    os.kill(served.stub_pid("prefill_0_0"), signal.SIGKILL)
    served.until(lambda: served.probe("/ready")[0] == 503, 2.0, "/ready turning false")
    served.until(served.serves, 5.0, "serving again")
    assert served.probe("/ready")[0] == 200 and _restarts(served)["prefill"] == 1
    [new_pool] = Path("/dev/shm").glob(f"disagg_{key}_prefill_0_0_*")  # the dead one's pool is gone
    assert new_pool != pool and new_pool.name.endswith(f"_{served.stub_pid('prefill_0_0')}")


def test_a_stopped_decode_is_ended_and_reloaded_and_its_requests_fail_naming_the_hop(served):
    """SIGSTOP: a stub cannot be resumed safely (README, Known problems), so the watchdog ends it after
    STOPPED_LIMIT_S and reloads it like a dead one."""
    before = _restarts(served).get("decode", 0)
    server_restarts = served.log.read_text().count("disagg-serve: tritonserver of decode ready again")
    # 300 tokens: about 0.5 s of decoding here, the window the stop must fall in (the prompt's few tokens
    # and these fit max_seq_len 320)
    expected = {i: stream(served.grpc_url, "aggregated", f"stopped {i}", 300, end_id=NO_END_ID).text for i in range(4)}
    outcomes: dict[int, tuple[str, str, float]] = {}

    streaming = threading.Event()

    def one(i: int) -> None:
        try:
            outcomes[i] = ("ok", stream(served.grpc_url, "ensemble", f"stopped {i}", 300, end_id=NO_END_ID, timeout_s=30,
                                        on_text=lambda _t: streaming.set()).text, 0.0)
        except Exception as exc:  # noqa: BLE001 - what the client sees is the point
            outcomes[i] = ("error", str(exc), time.monotonic() - stopped_at)

    pid = served.stub_pid("decode_0_0")  # found before the streams start: only the stop follows their first text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert streaming.wait(10)
    time.sleep(0.05)
    stopped_at = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    served.until(lambda: served.probe("/ready")[0] == 503, 3.0, "/ready turning false for a stopped engine")
    for t in threads:
        t.join(30)
    errors = [(msg, after) for kind, msg, after in outcomes.values() if kind == "error"]
    assert errors, "every stream finished before the stop: nothing was tested"
    for msg, after in errors:
        assert "decode: engine instance decode_0_0" in msg and "died while serving this request" in msg, msg
        assert after < watchdog.STOPPED_LIMIT_S + 2.0, f"failed {after:.1f} s after the stop"
    assert all(text == expected[i] for i, (kind, text, _) in outcomes.items() if kind == "ok")
    served.until(lambda: served.probe("/ready")[0] == 200, 5.0, "/ready true again after the reload")
    # Reloaded by the watchdog, or, when ending the stopped stub aborted decode's own server, that server
    # restarted: then the orchestrator's channel to it reconnects after gRPC's backoff, as after a kill of
    # the engine server (test_a_killed_engine_server_is_started_again...), within the same 5 s.
    served.until(served.serves, 5.0, "serving again after the reload")
    # the count and the log line may follow the serving engine by a moment
    served.until(lambda: _restarts(served).get("decode") == before + 1
                 or served.log.read_text().count("disagg-serve: tritonserver of decode ready again") > server_restarts,
                 5.0, "a reload counted or decode's server logged ready again")
    assert "has been stopped for" in served.log.read_text()
    assert not pid_alive(pid)


def test_a_hung_server_is_killed_and_started_again(served):
    """A tritonserver that answers nothing (stopped here; a crash deadlocked in its signal handler looks
    the same) is killed after --hung-after-secs and started again on the same ports."""
    os.kill(served.main_pid(), signal.SIGSTOP)
    waited = served.until(lambda: "disagg-serve: tritonserver ready again" in served.log.read_text(), HUNG_AFTER_S + 60,
                          "the hung server started again")
    assert waited > HUNG_AFTER_S
    assert "answered no liveness probe" in served.log.read_text()
    assert served.serves()


def test_a_killed_engine_server_is_started_again_and_the_main_server_stays_up(served):
    """disagg-serve runs each engine model in a tritonserver of its own: one that aborts (as a stub killed
    inside an interprocess lock makes it) takes only that engine down for a moment."""
    main_pid = served.main_pid()
    [engine_server] = [p for p in map(int, subprocess.run(["pgrep", "-P", str(served.proc.pid), "-f", "tritonserver .*load-model=decode"],
                                                          capture_output=True, text=True).stdout.split())]
    ready_again = "disagg-serve: tritonserver of decode ready again"
    restarted = served.log.read_text().count(ready_again)  # an earlier kill may already have restarted it
    os.kill(engine_server, signal.SIGKILL)
    served.until(lambda: served.log.read_text().count(ready_again) > restarted, 30.0, "decode's server started again")
    served.until(served.serves, 5.0, "serving again")
    assert served.main_pid() == main_pid
    assert served.probe("/ready")[0] == 200


def test_kill_9_of_the_server_leaves_nothing_in_shared_memory(served):
    """Last in this module: kills the main server. disagg-serve sweeps what the stubs left and starts it
    again; after its own stop nothing is left either. No server waited for an HTTP connection: the
    watchdog's, kept alive after a heal, held that engine's server for its whole exit timeout, after which
    it gave up on its models."""
    key = board_key(served.repo)
    restarted = served.log.read_text().count("disagg-serve: tritonserver ready again")
    os.kill(served.main_pid(), signal.SIGKILL)
    served.until(lambda: served.log.read_text().count("disagg-serve: tritonserver ready again") > restarted, 60.0, "the server started again")
    assert served.serves()
    served.proc.send_signal(signal.SIGTERM)
    served.proc.wait(60)
    log = served.log.read_text()
    assert "disagg-serve: prefill: reloaded" in log  # this module healed engines before
    assert "HTTP service connections" not in log, log[-3000:]
    assert [p.name for p in deployment_objects(key)] == []
    assert not list(Path("/dev/shm").glob(f"disagg*{key}*"))
