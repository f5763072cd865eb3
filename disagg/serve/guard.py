"""A server's guard process: ends a server whose starter died, even one that does not stop by itself.

A tritonserver gets SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG, disagg.serve.server)
and normally exits within its exit timeout. One that does not (stopped, deadlocked in its own fatal-signal
handler, waiting for a model whose stub died) keeps its ports, its stubs and their shared memory, and the
process that would have called `TritonServer.stop` is gone. So `TritonServer.start` starts a guard beside
each server, in a session of its own (a signal to the starter's process group does not reach it), and
tells it on stdin what `stop` would clean. Once the starter has died, the guard gives the server its exit
timeout and the stop's grace, then ends the server's process group and removes what it left, as `stop`
does (disagg.serve.leftovers.end_server). While the starter lives the guard only watches: it leaves when
the server exits, and `stop` ends it before stopping the server.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from disagg.serve.leftovers import end_server
from disagg.triton.load_board import pid_alive

POLL_S = 0.25


@dataclass(frozen=True)
class Orders:
    """What the guard is told, as one JSON line on its stdin."""

    starter: int  # the process that started the server (the guard's parent)
    server: int  # the server's pid, also its process group
    wait_s: float  # once the starter died: how long the server may take to exit by itself
    board_key: str  # as `stop` sweeps: the deployment's shared memory
    since: list[str]  # /dev/shm's names before the server started
    regions_only: bool
    workdir: str

    def to_json(self) -> str:
        return json.dumps(self.__dict__)


def guard(orders: Orders) -> None:
    while os.getppid() == orders.starter:
        if not pid_alive(orders.server):
            return  # the starter stops or restarts it, and cleans up
        time.sleep(POLL_S)
    deadline = time.monotonic() + orders.wait_s
    while pid_alive(orders.server) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    end_server(orders.server, orders.board_key, set(orders.since), orders.regions_only, Path(orders.workdir))


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # `stop` ends it with SIGKILL
        signal.signal(sig, signal.SIG_IGN)
    guard(Orders(**json.loads(sys.stdin.readline())))

