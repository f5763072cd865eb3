"""The cancel flag between postprocessing and the orchestrator, on a board in a scratch directory."""
from __future__ import annotations

import pytest

from disagg.triton import cancel_board


@pytest.fixture(autouse=True)
def board(tmp_path, monkeypatch):
    monkeypatch.setenv("DISAGG_LOAD_BOARD", str(tmp_path))
    return tmp_path


def test_a_raised_flag_is_seen_and_closing_leaves_nothing(board):
    flag = cancel_board.CancelFlag("k", "disagg_orchestrator_0_0", "abc123")
    other = cancel_board.CancelFlag("k", "disagg_orchestrator_0_0", "def456")
    assert flag.stream_id == "disagg_orchestrator_0_0.abc123"
    assert not flag.is_raised()
    assert cancel_board.raise_flag("k", flag.stream_id) is True
    assert flag.is_raised() and not other.is_raised()
    flag.close()
    other.close()
    assert list(board.iterdir()) == []


def test_raising_after_the_request_ended_creates_nothing(board):
    flag = cancel_board.CancelFlag("k", "o", "r1")
    flag.close()
    assert cancel_board.raise_flag("k", flag.stream_id) is False
    assert cancel_board.raise_flag("other-board", "o.r1") is False
    assert list(board.iterdir()) == []


@pytest.mark.parametrize("stream_id", ["../../etc/passwd", "a/b", "", ".hidden", "x y"])
def test_a_stream_id_cannot_leave_the_board(board, stream_id):
    with pytest.raises(ValueError, match="is not a stream id"):
        cancel_board.raise_flag("k", stream_id)


def test_an_instance_removes_only_its_own_leftovers(board):
    mine = [cancel_board.CancelFlag("k", "orch_0_0", f"r{i}") for i in range(3)]
    theirs = cancel_board.CancelFlag("k", "orch_0_1", "r0")
    assert cancel_board.remove_leftovers("k", "orch_0_0") == 3
    assert not any(f.path.exists() for f in mine) and theirs.path.exists()


def test_a_throttle_is_due_at_most_once_per_period():
    now, later = cancel_board.Throttle(60.0), cancel_board.Throttle(60.0, due_now=False)
    assert [now.due(), now.due()] == [True, False]
    assert later.due() is False
    fast = cancel_board.Throttle(0.0)
    assert [fast.due(), fast.due()] == [True, True]
