"""The engine stand-in that skips compute: each step takes step time + time per token it computes, without
the CPU, and each sequence's next token is a fixed function of its last one."""
from __future__ import annotations

import time

import numpy as np

from disagg.engine.llama import StepInput
from disagg.engine.no_compute import NoComputeModel


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
