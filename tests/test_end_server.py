"""`end_server` waits for the server's process group to stop running, not for its zombies to be reaped: a stub's
helper process that outlives the stub is adopted by init, and an init that reaps once a second kept every stop
0.4-1.2 s longer (disagg.serve.leftovers)."""
from __future__ import annotations

import subprocess
import sys
import time

from disagg.serve import leftovers
from disagg.triton.load_board import process_group, process_state

# A group leader that leaves a child of its own a zombie (never reaped), then waits to be killed.
LEADER = "import os, time\nif os.fork() == 0:\n    os._exit(0)\nprint('forked', flush=True)\ntime.sleep(60)\n"


def _members(pgid: int) -> list[tuple[int, str]]:
    return [(pid, process_state(pid)) for pid in leftovers._pids() if process_group(pid) == pgid]  # noqa: SLF001


def test_a_group_of_zombies_is_ended_at_once(tmp_path):
    leader = subprocess.Popen([sys.executable, "-c", LEADER], start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert leader.stdout.readline() == "forked\n"
        deadline = time.monotonic() + 5
        while sorted(state for _, state in _members(leader.pid)) != ["S", "Z"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(state for _, state in _members(leader.pid)) == ["S", "Z"]  # the leader sleeping, its child a zombie
        assert leftovers.group_running(leader.pid)

        started = time.monotonic()
        leftovers.end_server(leader.pid, "no-such-deployment", since=None, regions_only=True, workdir=tmp_path)
        took = time.monotonic() - started
        assert {state for _, state in _members(leader.pid)} == {"Z"}  # killed, and nobody has reaped it yet
        assert not leftovers.group_running(leader.pid)
        assert took < 1.0, f"end_server waited {took:.2f} s for a group with nothing left running"
        assert not tmp_path.exists()
    finally:
        leader.kill()
        leader.wait()
