"""Decode routing by load: the board engines publish, and the orchestrator's choice from it."""
from __future__ import annotations

import json
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
