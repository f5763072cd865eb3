"""The engine stand-in that skips compute: each step takes step time + time per token it computes, without
the CPU, and each sequence's next token is a fixed function of its last one."""
from __future__ import annotations

import os
import time

import numpy as np

from disagg.engine.llama import StepInput
from disagg.engine.no_compute import NoComputeModel, skipped_compute, stand_in_key


def test_a_step_takes_its_step_time_plus_its_tokens_time_and_no_cpu():
    model = NoComputeModel(vocab_size=100, step_s=0.02, token_s=0.002)
    batch = [StepInput(np.arange(10), 0, [0]), StepInput(np.array([41]), 12, [1])]  # a 10-token prompt, one decode
    wall, cpu = time.perf_counter(), time.process_time()
    logits = model.forward(batch)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.042 <= wall < 0.2 and cpu < 0.01, (wall, cpu)  # 20 ms + 11 x 2 ms
    assert logits.argmax(axis=1).tolist() == [(9 * 31 + 7) % 100, (41 * 31 + 7) % 100]


def test_steps_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("DISAGG_SKIP_COMPUTE_STEP_MS", "30")
    monkeypatch.setenv("DISAGG_SKIP_COMPUTE_TOKEN_MS", "1.5")
    model = NoComputeModel(vocab_size=8)
    assert (model.step_s, model.token_s) == (0.03, 0.0015)


def test_skipped_compute_sets_the_stand_in_for_what_runs_inside_and_restores_what_was_there(monkeypatch):
    monkeypatch.setenv("DISAGG_SKIP_COMPUTE_TOKEN_MS", "9")
    monkeypatch.delenv("DISAGG_SKIP_COMPUTE", raising=False)
    monkeypatch.delenv("DISAGG_SKIP_COMPUTE_STEP_MS", raising=False)
    assert stand_in_key() == ""
    with skipped_compute(20.0, 1.5):
        model = NoComputeModel(vocab_size=8)
        assert (model.step_s, model.token_s) == (0.02, 0.0015)
        assert stand_in_key() == "stand-in 20.0 ms + 1.5 ms/token"
        with skipped_compute(5.0):  # the front bench's engines inside a stand-in run: no token time of the outer one
            assert NoComputeModel(vocab_size=8).token_s == 0.0
        assert stand_in_key() == "stand-in 20.0 ms + 1.5 ms/token"
    assert os.environ.get("DISAGG_SKIP_COMPUTE") is None and os.environ.get("DISAGG_SKIP_COMPUTE_STEP_MS") is None
    assert os.environ["DISAGG_SKIP_COMPUTE_TOKEN_MS"] == "9"
