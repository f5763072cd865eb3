"""Decode routing by load: the board engines publish, and the orchestrator's choice from it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from disagg.render import plan_models
from disagg.repository import role_models
from disagg.spec import parse_spec
from disagg.triton import load_board


@pytest.fixture
def board(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_LOAD_BOARD", str(tmp_path))
    return tmp_path


def test_fewest_in_flight_then_most_free_blocks(board):
    load_board.publish("k", "decode", "decode_0", in_flight=5, free_blocks=100)
    load_board.publish("k", "decode_1", "decode_1_0", in_flight=2, free_blocks=10)
    load_board.publish("k", "decode_2", "decode_2_0", in_flight=2, free_blocks=300)
    board_view = load_board.BoardView("k")
    models = ["decode", "decode_1", "decode_2"]
    assert min(models, key=lambda m: load_board.load_score(board_view, m, 0)) == "decode_2"
    # requests this orchestrator has in flight count even before the board shows them
    dispatched = {"decode_2": 6, "decode_1": 6}
    assert min(models, key=lambda m: load_board.load_score(board_view, m, dispatched.get(m, 0))) == "decode"


def test_instances_of_a_model_add_up_and_stale_entries_are_ignored(board):
    load_board.publish("k", "decode", "decode_0", in_flight=1, free_blocks=10)
    load_board.publish("k", "decode", "decode_1", in_flight=2, free_blocks=20)
    stale = board / "disagg-load-k-decode_1-decode_1_0.json"
    stale.write_text(json.dumps({"in_flight": 0, "free_blocks": 999, "updated": time.time() - 60}))
    assert load_board.model_load("k", "decode").in_flight == 3
    assert load_board.model_load("k", "decode").free_blocks == 30
    assert load_board.model_load("k", "decode_1") is None
    assert load_board.model_load("other-server", "decode") is None


def test_each_decode_instance_is_its_own_model():
    raw = yaml.safe_load(open("configs/cpu-tiny.yaml"))
    raw["roles"]["decode"]["instances"] = 3
    spec = parse_spec(raw)
    assert role_models(spec, "decode") == ["decode", "decode_1", "decode_2"]
    models = {m.name: m.config for m in plan_models(spec)}
    assert {"decode", "decode_1", "decode_2"} <= set(models)
    assert 'string_value: "decode,decode_1,decode_2"' in models["disagg_orchestrator"]
    assert "count: 1" in models["decode_2"]


def test_a_started_view_reads_the_board_on_its_own_thread_while_it_is_asked(board, monkeypatch):
    load_board.publish("k", "decode", "decode_0", in_flight=1, free_blocks=10)
    readers = []
    real = load_board.entries
    monkeypatch.setattr(load_board, "entries", lambda *a: readers.append(threading.current_thread().name) or real(*a))
    view = load_board.BoardView("k", max_age_s=0.05, idle_after_s=0.4).start()
    try:
        assert [e.load.in_flight for e in view.entries("decode")] == [1]
        assert readers == ["MainThread"]  # nobody had asked: the first caller reads itself
        load_board.publish("k", "decode", "decode_1", in_flight=3, free_blocks=5)
        for _ in range(30):  # asked every 10 ms: the thread keeps the view fresh, no caller reads
            time.sleep(0.01)
            view.entries("decode")
        assert sorted(e.load.in_flight for e in view.entries("decode")) == [1, 3]
        assert set(readers[1:]) == {"load-board"} and len(readers) >= 3, readers
        time.sleep(0.6)  # nobody asks: after idle_after_s the thread stops reading
        idle = len(readers)
        time.sleep(0.3)
        assert len(readers) == idle
        view.entries("decode")
        assert readers[idle] == "MainThread"
    finally:
        view.close()
    assert not any(t.name == "load-board" for t in threading.enumerate())
    # not started: the caller reads, at most every max_age_s
    readers.clear()
    view = load_board.BoardView("k", max_age_s=60)
    assert sorted(e.instance for e in view.entries("decode")) == ["decode_0", "decode_1"]
    view.entries("decode")
    assert readers == ["MainThread"]


ANOTHER_SERVER = """
import subprocess, sys
stub = subprocess.Popen([sys.argv[1], "-c", "import time\\nfrom disagg.triton import load_board\\n"
                         "while True:\\n    load_board.publish('k', 'prefill', 'prefill_0_0', 0, 8)\\n    time.sleep(0.05)"])
stub.wait()
"""


def _published_by_a_stub_of(command: str) -> tuple[int | None, int]:
    """What served_elsewhere finds once a process run as `command` has a stub publishing prefill_0_0, and that process."""
    server = subprocess.Popen([command, "-c", ANOTHER_SERVER, sys.executable], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            entry = next((e for e in load_board.entries("k", "prefill") if e.load.pid != os.getpid()), None)
            if entry is not None and load_board.parent_pid(entry.load.pid) == server.pid:
                return load_board.served_elsewhere("k", "prefill", "prefill_0_0"), server.pid
            time.sleep(0.05)
        raise AssertionError(f"no stub of {command} published within 10 s")
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def test_an_instance_another_live_server_publishes_is_found_and_its_own_or_a_dead_ones_is_not(board):
    """Another process tree (a tritonserver and its stub) publishing under the instance's name is named by its server's
    pid; an entry of this process's own parent, a dead process's, or one whose parent is no tritonserver is not another
    server's."""
    tritonserver = board / "tritonserver"  # a server is known by its command's name
    tritonserver.symlink_to(sys.executable)
    found, server = _published_by_a_stub_of(str(tritonserver))
    assert found == server
    time.sleep(0.2)  # the stub, killed with its group, is reaped by init
    assert load_board.served_elsewhere("k", "prefill", "prefill_0_0") is None  # no live process
    found, _ = _published_by_a_stub_of(sys.executable)
    assert found is None  # its parent is not a tritonserver
    load_board.publish("k", "prefill", "prefill_0_0", 0, 8)  # this process: its parent is ours
    assert load_board.served_elsewhere("k", "prefill", "prefill_0_0") is None
    assert load_board.served_elsewhere("k", "decode", "decode_0_0") is None  # nothing published
