"""Brings dead engine instances back without a person.

Triton does not restart a Python model whose stub process died: every later request to it fails with
"Stub process ... is not healthy" and the model still reports READY. Engine instances publish their
process id on the load board; the watchdog polls it and, for a model with a dead instance, unloads and
loads that model through Triton's model-control API (the server must run with
`--model-control-mode=explicit`; a plain reload of a loaded model is a no-op). The model is back in about
0.7 s on the CPU default (with config auto-completion off, as disagg-serve runs it; 3 s with it on). A
model that dies again within `STABLE_S` of its last restart waits twice as long as before (1, 2, 4 ... up
to `MAX_BACKOFF_S`) so a crash loop does not monopolise the server. Each restart is logged and counted
on the board (`load_board.count_restart`), which the engine models export as the metric
`disagg_engine_restarts`. An instance that died with its server (killing a stub inside an interprocess lock
aborts tritonserver: `crashed(model)`) is not reloaded into that server, which is about to be killed and
started again with its models (disagg/serve/supervisor.py): a reload there would be undone within seconds
and would make the deployment look ready meanwhile.

A stopped instance (SIGSTOP, state T) is ended after `STOPPED_LIMIT_S` and then reloaded like a dead one.
Triton 2.51's Python backend cannot take a stub back after a stop: the parent fails its requests after a
second ("Stub process ... is not healthy"), the resumed stub aborts on an interprocess lock
(`boost::interprocess::lock_exception`), and unloading it then aborted tritonserver too. A stub killed
while stopped is unloaded and reloaded cleanly, like any other dead one.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from disagg.triton import load_board

POLL_S = 0.25
STABLE_S = 60.0
MAX_BACKOFF_S = 30.0
STOPPED_LIMIT_S = 0.5


@dataclass
class _History:
    restarts: int = 0
    last: float = 0.0
    backoff_s: float = 0.0
    dead_pids: set[int] = field(default_factory=set)


class Watchdog:
    """Polls the board of deployment `key` on a thread of its own and reloads models whose instances died,
    through `client_for(model)` (a tritonclient InferenceServerClient of the server running it). `log(line)`
    reports each event; `crashed(model)` says whether the server running `model` printed a fatal signal."""

    def __init__(self, key: str, client_for, log=print, crashed=lambda _model: False):
        self.key, self.client_for, self.log, self.crashed = key, client_for, log, crashed
        self.history: dict[str, _History] = {}
        self._stopped_since: dict[int, float] = {}  # pid -> when it was first seen stopped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def halt(self) -> None:
        """Stops reloading from now on, without waiting (safe in a signal handler)."""
        self._stop.set()

    def stop(self) -> None:
        self.halt()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            for entry in load_board.entries(self.key):
                if not entry.load.pid or self._stop.is_set():
                    continue
                state = load_board.process_state(entry.load.pid)
                if state in (None, "Z"):
                    self._heal(entry)
                elif state == "T":
                    self._end_if_stopped_too_long(entry)
                else:
                    self._stopped_since.pop(entry.load.pid, None)

    def _end_if_stopped_too_long(self, entry: load_board.Entry) -> None:
        since = self._stopped_since.setdefault(entry.load.pid, time.monotonic())
        if time.monotonic() - since < STOPPED_LIMIT_S:
            return
        self.log(f"{entry.model}: instance {entry.instance} (pid {entry.load.pid}) has been stopped for "
                 f"{time.monotonic() - since:.1f} s; ending it (a stub resumed after a stop aborts)")
        try:
            os.kill(entry.load.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        del self._stopped_since[entry.load.pid]

    def _still_dead(self, entry: load_board.Entry) -> bool:
        """Whether the board still names `entry`'s dead process for its instance."""
        return any(e.instance == entry.instance and e.load.pid == entry.load.pid for e in load_board.entries(self.key, entry.model))

    def _heal(self, entry: load_board.Entry) -> None:
        h = self.history.setdefault(entry.model, _History())
        if entry.load.pid in h.dead_pids:
            return  # being healed, or waiting out its back-off
        if self.crashed(entry.model):
            h.dead_pids.add(entry.load.pid)
            self.log(f"{entry.model}: instance {entry.instance} (pid {entry.load.pid}) died with its tritonserver, "
                     "which is to be started again with it")
            return
        client = self.client_for(entry.model)
        try:
            self._reload(entry, h, client)
        finally:
            # A connection kept alive holds the server's stop for its whole exit timeout (tritonserver waits
            # for its HTTP connections to close first), after which it gives up unloading its models.
            client.close()

    def _reload(self, entry: load_board.Entry, h: _History, client) -> None:
        try:
            # A server that is down is restarted by its supervisor; one that is not ready with the model is
            # loading it afresh (a restarted server): the new instance replaces the dead entry.
            if not client.is_server_live() or not client.is_model_ready(entry.model):
                return
        except Exception:  # noqa: BLE001 - the server itself is down
            return
        if not self._still_dead(entry):
            return  # a restarted server's new instance replaced the entry since the poll read it
        now = time.monotonic()
        h.backoff_s = 0.0 if now - h.last > STABLE_S or not h.restarts else min(MAX_BACKOFF_S, max(1.0, 2 * h.backoff_s))
        wait = h.last + h.backoff_s - now
        h.dead_pids.add(entry.load.pid)
        self.log(f"{entry.model}: instance {entry.instance} (pid {entry.load.pid}) died; reloading the model"
                 + (f" in {wait:.0f} s (back-off after {h.restarts} restarts)" if wait > 0 else ""))
        if wait > 0 and self._stop.wait(wait):
            return
        started = time.monotonic()
        try:
            client.unload_model(entry.model)
            while client.is_model_ready(entry.model) and not self._stop.is_set():
                time.sleep(0.05)
            h.restarts += 1
            load_board.count_restart(self.key, entry.model)
            client.load_model(entry.model)
        except Exception as exc:  # noqa: BLE001 - the next poll tries again
            self.log(f"{entry.model}: reload failed: {exc}")
            h.dead_pids.discard(entry.load.pid)
            return
        finally:
            h.last = time.monotonic()
        # The new instance publishes under the same name with its own pid, replacing the dead entry.
        self.log(f"{entry.model}: reloaded in {time.monotonic() - started:.1f} s (restart {h.restarts})")
