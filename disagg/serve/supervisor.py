"""Keeps one tritonserver running: started again, on the same ports, when it dies on its own or hangs.

A server that exits without being told to (a crash) is stopped properly (its process group ended, what
it left swept) and started again at once, then after 1, 2, 4 ... s, at most MAX_SERVER_RESTARTS times within
RESTART_WINDOW_S. A server that printed a fatal signal and is still running CRASH_EXIT_S later, or has
answered no liveness probe for `hung_after_s` (HUNG_AFTER_S unless told), is killed first: a crash that deadlocks in tritonserver's
signal handler (`malloc(): unaligned tcache chunk detected`, then `Signal (6) received.` over and over)
leaves a process that serves nothing, never exits, and may still answer `/v2/health/live`.
One told to stop that is still running `--exit-timeout-secs` + STOP_GRACE_S later is killed too.
Clients (the API, the watchdog, an orchestrator) reach the new server at the same addresses. An engine
server's restart counts as a restart of its engine model (`on_restart`), as the watchdog's reloads do.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

from disagg.serve.server import TritonServer

PREFIX = "disagg-serve:"
MAX_SERVER_RESTARTS = 5
RESTART_WINDOW_S = 600.0
HUNG_AFTER_S = 15.0
CRASH_EXIT_S = 2.0
POLL_S = 0.25  # how often the process and its fatal-signal line are looked at
LIVE_PROBE_S = 1.0  # how often it is asked for liveness, an HTTP request
STOP_GRACE_S = 10.0


class Supervised:
    """`new_server()` builds the server (same ports every time); `signalled` is non-empty once a stop was
    asked for; `name` is how the log calls it; `on_restart()` is called as a crashed server is started again;
    `hung_after_s`: how long without an answer to a liveness probe before the server is killed."""

    def __init__(self, name: str, new_server: Callable[[], TritonServer], signalled: list[int],
                 on_restart: Callable[[], None] = lambda: None, hung_after_s: float = HUNG_AFTER_S):
        self.name, self.new_server, self.signalled, self.on_restart = name, new_server, signalled, on_restart
        self.hung_after_s = hung_after_s
        self.server = new_server()
        self.restarts = 0

    def run(self, ready_timeout_s: float) -> int:
        """Until a stop is asked for, or the server crashed too often; returns its last exit code."""
        crashes: list[float] = []
        while True:
            code = self._wait()
            if self.signalled:
                return code
            now = time.monotonic()
            crashes = [t for t in crashes if now - t < RESTART_WINDOW_S] + [now]
            if len(crashes) > MAX_SERVER_RESTARTS:
                self._log(f"{self.name} exited with code {code} {len(crashes)} times in {RESTART_WINDOW_S:.0f} s; giving up")
                return code
            self.server.stop()  # ends its stubs, sweeps what it left
            delay = 0.0 if len(crashes) == 1 else 2.0 ** (len(crashes) - 2)
            self.restarts += 1
            self._log(f"{self.name} exited with code {code}; starting it again in {delay:.0f} s (server restart {len(crashes)})")
            time.sleep(delay)
            if self.signalled:
                return code
            self.on_restart()
            self.server = self.new_server().start()
            self.server.wait_ready(ready_timeout_s)
            self._log(f"{self.name} ready again")

    def _wait(self) -> int:
        server = self.server
        last_live = last_probe = time.monotonic()
        stop_asked = None
        while True:
            try:
                return server.process.wait(timeout=POLL_S)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if self.signalled:
                stop_asked = stop_asked or now
                if now - stop_asked > (server.exit_timeout_s or 30) + STOP_GRACE_S:
                    self._log(f"{self.name} still running {now - stop_asked:.0f} s after the stop; killing it")
                    server.process.kill()
            elif server.crashed_at is not None and now - server.crashed_at > CRASH_EXIT_S:
                self._log(f"{self.name} printed {server.crash_line!r} and is still running {now - server.crashed_at:.0f} s later; killing it")
                server.process.kill()
                server.crashed_at = None
            elif now - last_probe >= LIVE_PROBE_S:
                last_probe = now
                if server.is_live():
                    last_live = now
                elif now - last_live > self.hung_after_s:
                    self._log(f"{self.name} has answered no liveness probe for {now - last_live:.0f} s; killing it")
                    server.process.kill()
                    last_live = now

    @staticmethod
    def _log(line: str) -> None:
        print(f"{PREFIX} {line}", flush=True)
