"""The supervisor against a stand-in tritonserver (first on PATH, run by TritonServer as a real one would
be): a crash that deadlocks in the signal handler, still answering liveness, is killed and restarted. And
a server is ready only once its metrics port listens too."""
from __future__ import annotations

import os
import re
import sys
import threading
import time
import urllib.request

from disagg.serve.server import TritonServer
from disagg.serve.supervisor import CRASH_EXIT_S, Supervised

# Answers every GET with 200 (live, ready) on --http-port, and on --metrics-port from `metrics_after` s on.
# The first run prints what tritonserver prints when malloc finds its heap corrupted, then keeps serving as
# the deadlocked server did; later runs do not.
STAND_IN = '''#!{python}
import http.server, sys, threading, time
from pathlib import Path
class Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *args):
        pass
def serve(flag, after_s):
    time.sleep(after_s)
    port = int(next(a.split("=")[1] for a in sys.argv if a.startswith(flag)))
    http.server.ThreadingHTTPServer(("127.0.0.1", port), Live).serve_forever()
threading.Thread(target=serve, args=("--http-port=", 0), daemon=True).start()
threading.Thread(target=serve, args=("--metrics-port=", {metrics_after}), daemon=True).start()
marker = Path("{marker}")
print("I1201 started", flush=True)
if not marker.exists():
    marker.touch()
    time.sleep(0.5)
    print("malloc(): unaligned tcache chunk detected", flush=True)
    print("Signal (6) received.", flush=True)
time.sleep(120)
'''


def _stand_in(tmp_path, monkeypatch, metrics_after_s: float = 0.0) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "tritonserver"
    stand_in.write_text(STAND_IN.format(python=sys.executable, marker=tmp_path / "crashed-once", metrics_after=metrics_after_s))
    stand_in.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_ready_waits_for_the_metrics_port(tmp_path, monkeypatch):
    """Triton opens its metrics port after the HTTP one; a scrape right after ready was refused."""
    _stand_in(tmp_path, monkeypatch, metrics_after_s=1.5)
    (tmp_path / "crashed-once").touch()  # no crash in this one
    repo = tmp_path / "model_repository"
    repo.mkdir()
    server = TritonServer(repo, label="decode", sweeps_deployment=False)
    started = time.monotonic()
    try:
        server.start().wait_ready(30)
        assert time.monotonic() - started >= 1.5
        with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
            assert response.status == 200
    finally:
        server.stop()


def test_a_crash_that_deadlocks_is_killed_and_restarted(tmp_path, monkeypatch, capfd):
    _stand_in(tmp_path, monkeypatch)
    repo = tmp_path / "model_repository"
    repo.mkdir()
    signalled: list[int] = []
    restarts: list[float] = []
    sup = Supervised("tritonserver of decode", lambda: TritonServer(repo, label="decode", sweeps_deployment=False), signalled,
                     on_restart=lambda: restarts.append(time.monotonic()))
    sup.server.start().wait_ready(30)
    first = sup.server
    runner = threading.Thread(target=sup.run, args=(30,), daemon=True)
    started = time.monotonic()
    runner.start()
    try:
        while not (sup.server is not first and sup.server.is_live()) and time.monotonic() - started < 15:
            time.sleep(0.1)
        assert CRASH_EXIT_S < time.monotonic() - started < CRASH_EXIT_S + 3
        assert sup.restarts == 1 and first.process.returncode == -9  # killed: it would never have exited
        assert len(restarts) == 1  # counted as its engine model's restart
        time.sleep(0.5)  # the supervisor sees it ready too
    finally:
        signalled.append(15)
        sup.server.stop()
        runner.join(15)
    out = capfd.readouterr().out
    assert "[decode] malloc(): unaligned tcache chunk detected\n[decode] Signal (6) received.\n" in out
    assert re.search(r"^disagg-serve: tritonserver of decode printed 'Signal \(6\) received\.' and is still running 2 s later; killing it$", out, re.M)
    assert "disagg-serve: tritonserver of decode exited with code -9; starting it again in 0 s (server restart 1)" in out
    assert not runner.is_alive()
