"""A server whose starter dies and that does not stop by itself is ended by its guard (disagg.serve.guard),
and what it held goes with it: its stubs, their shared memory, its work directory.

The server is a real tritonserver with a Python model; it is SIGSTOPped, so the SIGTERM its starter's death
sends it (PR_SET_PDEATHSIG) can do nothing, as with a server wedged in its own crash handler."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from disagg.serve import leftovers
from disagg.triton.load_board import pid_alive

pytestmark = pytest.mark.e2e

MODEL = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("y", r.inputs()[0].as_numpy())]) for r in requests]
'''
CONFIG = '''
backend: "python"
max_batch_size: 0
input [ { name: "x" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "y" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
'''
STARTER = '''
import sys, time
from disagg.serve.server import TritonServer

server = TritonServer(sys.argv[1], exit_timeout_s=1, log_path=sys.argv[2])
server.stop_grace_s = 0.5
server.start()
server.wait_ready()
print(server.process.pid, server._workdir, flush=True)
time.sleep(300)
'''
EXIT_TIMEOUT_S, GRACE_S = 1, 0.5


def test_a_wedged_server_whose_starter_died_is_ended_with_its_stubs_and_shared_memory(tmp_path):
    repo = tmp_path / "repo"
    (repo / "echo" / "1").mkdir(parents=True)
    (repo / "echo" / "config.pbtxt").write_text(CONFIG)
    (repo / "echo" / "1" / "model.py").write_text(MODEL)
    shm_before = leftovers.names()
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(STARTER), str(repo), str(tmp_path / "server.log")],
                               stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    server = None
    try:
        line = starter.stdout.readline().split()
        assert len(line) == 2, f"the starter did not start a server: {(tmp_path / 'server.log').read_text()[-2000:]}"
        server, workdir = int(line[0]), Path(line[1])
        stubs = leftovers.children_of(server)
        regions = {n for n in leftovers.names() - shm_before if n.startswith("triton_python_backend_shm_region_")}
        assert stubs and regions and workdir.is_dir()

        os.kill(server, signal.SIGSTOP)  # deaf to the SIGTERM its starter's death sends it
        starter.kill()
        starter.wait()
        died = time.monotonic()
        time.sleep(EXIT_TIMEOUT_S + GRACE_S - 0.5)
        assert pid_alive(server), "the server was ended before its exit timeout and grace were over"
        deadline = died + EXIT_TIMEOUT_S + GRACE_S + 10
        while time.monotonic() < deadline and (any(pid_alive(p) for p in [server, *stubs]) or regions & leftovers.names() or workdir.exists()):
            time.sleep(0.1)
        assert [p for p in [server, *stubs] if pid_alive(p)] == []
        assert regions & leftovers.names() == set(), "the stubs' shared memory was left behind"
        assert not workdir.exists()
    finally:
        starter.kill()
        starter.wait()
        if server is not None and pid_alive(server):
            leftovers.end_server(server, "", shm_before, True, None)


def test_while_the_starter_lives_the_guard_leaves_when_the_server_exits_and_ends_nothing(monkeypatch):
    from disagg.serve import guard

    ended = []
    monkeypatch.setattr(guard, "end_server", lambda *args: ended.append(args))
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    orders = guard.Orders(os.getppid(), server.pid, 0.0, "key", [], True, "/nonexistent")
    started = time.monotonic()
    guard.guard(orders)  # this process's parent stands for the starter: alive throughout
    assert server.poll() is not None and time.monotonic() - started < 5 and ended == []
