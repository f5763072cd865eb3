"""The watchdog on a board of real processes (a `sleep` stands in for a stub) with a recording client in
place of Triton's: a dead instance's model is unloaded and loaded once; a stopped one is ended after
STOPPED_LIMIT_S and then reloaded; a running one is left alone, and so is a dead one whose (restarted)
server is loading the model afresh."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import asdict

import pytest

from disagg.serve import watchdog
from disagg.triton import load_board

KEY = "watchdogtest"


class RecordingClient:
    """Models are ready (Triton keeps one READY after its stub died) unless unloaded or listed `loading`."""

    def __init__(self, loading: tuple[str, ...] = ()):
        self.calls: list[tuple[str, str]] = []
        self.not_ready = set(loading)
        self.taken = self.closed = 0

    def is_server_live(self) -> bool:
        return True

    def is_model_ready(self, model: str) -> bool:
        return model not in self.not_ready

    def unload_model(self, model: str) -> None:
        self.calls.append(("unload", model))
        self.not_ready.add(model)

    def load_model(self, model: str) -> None:
        self.calls.append(("load", model))
        self.not_ready.discard(model)

    def __call__(self, _model: str) -> RecordingClient:
        """The watchdog's `client_for`: every client it takes must be closed (a kept-alive connection holds
        the server's stop for its exit timeout)."""
        self.taken += 1
        return self

    def close(self) -> None:
        self.closed += 1


@pytest.fixture()
def board(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_LOAD_BOARD", str(tmp_path))
    procs: list[subprocess.Popen] = []

    def instance(model: str) -> subprocess.Popen:
        proc = subprocess.Popen(["sleep", "60"])
        procs.append(proc)
        load = load_board.Load(0, 10, time.time(), proc.pid)
        (tmp_path / f"disagg-load-{KEY}-{model}-{model}_0_0.json").write_text(json.dumps(asdict(load)))
        return proc

    yield instance
    for proc in procs:
        proc.kill()
        proc.wait()


def _until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_a_dead_instance_is_reloaded_once_and_a_running_one_is_left_alone(board):
    dead, running = board("decode"), board("prefill")
    dead.kill()
    dead.wait()
    client, lines = RecordingClient(), []
    dog = watchdog.Watchdog(KEY, client, log=lines.append).start()
    try:
        assert _until(lambda: ("load", "decode") in client.calls, 5), lines
        time.sleep(4 * watchdog.POLL_S)  # the same dead pid is not reloaded again
    finally:
        dog.stop()
    assert client.calls == [("unload", "decode"), ("load", "decode")]
    assert client.taken == client.closed == 1
    assert running.poll() is None
    assert load_board.restarts(KEY) == {"decode": 1}


def test_a_stopped_instance_is_ended_after_the_limit_then_reloaded(board):
    stopped = board("decode")
    stopped.send_signal(signal.SIGSTOP)
    client, lines = RecordingClient(), []
    began = time.monotonic()
    dog = watchdog.Watchdog(KEY, client, log=lines.append).start()
    try:
        assert _until(lambda: stopped.poll() is not None, 5), lines
        ended_after = time.monotonic() - began
        assert _until(lambda: ("load", "decode") in client.calls, 5), lines
    finally:
        dog.stop()
    assert stopped.returncode == -signal.SIGKILL
    assert watchdog.STOPPED_LIMIT_S <= ended_after < watchdog.STOPPED_LIMIT_S + 4 * watchdog.POLL_S
    assert any("has been stopped for" in line and "ending it" in line for line in lines), lines
    assert client.calls == [("unload", "decode"), ("load", "decode")]


def test_a_dead_instance_of_a_model_its_server_is_loading_afresh_is_left_to_the_load(board):
    dead = board("decode")
    dead.kill()
    dead.wait()
    client, lines = RecordingClient(loading=("decode",)), []
    dog = watchdog.Watchdog(KEY, client, log=lines.append).start()
    try:
        time.sleep(6 * watchdog.POLL_S)
    finally:
        dog.stop()
    assert client.calls == [] and lines == []
    assert client.taken == client.closed > 0  # asked at every poll whether the model is ready


def test_a_dead_entry_replaced_by_a_new_instance_before_its_model_is_ready_is_left_alone(board):
    """A restarted server's instance publishes its pid in its initialize, before Triton calls the model ready;
    a poll that read the dead pid just before must not reload the new instance."""
    dead = board("decode")
    dead.kill()
    dead.wait()

    class Restarted(RecordingClient):
        replacement = None

        def is_model_ready(self, model: str) -> bool:
            if self.replacement is None:
                self.replacement = board(model)  # the new instance, published as its server becomes ready
            return super().is_model_ready(model)

    client, lines = Restarted(), []
    dog = watchdog.Watchdog(KEY, client, log=lines.append).start()
    try:
        assert _until(lambda: client.replacement is not None, 5)
        time.sleep(4 * watchdog.POLL_S)
    finally:
        dog.stop()
    assert client.calls == [] and lines == []


def test_a_dead_instance_whose_server_crashed_is_left_to_the_server_s_restart(board):
    """Killing a stub inside an interprocess lock aborts its tritonserver; the supervisor kills and restarts
    that server with its models, so a reload into it would only make the deployment look ready meanwhile."""
    dead = board("decode")
    dead.kill()
    dead.wait()
    client, lines = RecordingClient(), []
    dog = watchdog.Watchdog(KEY, client, log=lines.append, crashed=lambda model: model == "decode").start()
    try:
        assert _until(lambda: lines, 5)
        time.sleep(4 * watchdog.POLL_S)  # said once, not at every poll
    finally:
        dog.stop()
    assert client.calls == [] and load_board.restarts(KEY) == {}
    assert lines == [f"decode: instance decode_0_0 (pid {dead.pid}) died with its tritonserver, which is to be started again with it"]
