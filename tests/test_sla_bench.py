"""`python -m disagg.bench sla`'s arithmetic: which requests met their class, attainment with refusals
counted as missed, tokens/s over the counted window, and the verdict against the baselines."""
from __future__ import annotations

import pytest

from disagg.bench.sla import ClassFigures, PolicyRun, Request, figures, verdict

WINDOW = (10.0, 20.0)
TARGETS = (0.5, 0.1)  # TTFT 500 ms, TPOT 100 ms


def _answered(klass: str, sent: float, ttft: float, gap: float, tokens: int, counted: bool = True) -> Request:
    first = sent + ttft
    return Request(klass, sent, counted, stamps=[first + i * gap for i in range(tokens)], counts=[1] * tokens)


def test_a_request_meets_its_class_only_within_both_targets_and_refusals_count_as_missed():
    requests = [
        _answered("interactive", 11.0, 0.2, 0.05, 5),  # met
        _answered("interactive", 12.0, 0.6, 0.05, 5),  # TTFT missed
        _answered("interactive", 13.0, 0.2, 0.15, 5),  # TPOT missed
        Request("interactive", 14.0, True, error="service class 'interactive': no decode pool is predicted to meet its ..."),
        Request("interactive", 15.0, True, error="decode: engine failed"),
        _answered("interactive", 5.0, 0.2, 0.05, 5, counted=False),  # sent in the warm-up
    ]
    got = figures(requests, "interactive", TARGETS, WINDOW)
    assert (got.sent, got.completed, got.met, got.refused, got.failed) == (5, 3, 1, 1, 1)
    assert got.attainment == pytest.approx(0.2)
    assert got.ttft_ms[0] == pytest.approx(200.0)
    assert got.tpot_ms[0] == pytest.approx(50.0)
    assert got.tokens_per_s == pytest.approx(1.5)  # 15 tokens of the counted ones, 10 s (the warm-up's came before)


def test_a_class_without_targets_meets_it_by_completing_and_its_tokens_count_inside_the_window_only():
    requests = [_answered("batch", 9.0, 0.5, 0.5, 5, counted=False),  # tokens at 9.5 .. 11.5: 4 inside
                _answered("batch", 19.0, 0.5, 0.25, 6)]  # 19.5 .. 20.75: 3 inside
    got = figures(requests, "batch", (None, None), WINDOW)
    assert (got.sent, got.completed, got.met) == (1, 1, 1)
    assert got.tokens_per_s == pytest.approx(0.7)


def _run(policy: str, attainment: float, batch_tokens_per_s: float) -> PolicyRun:
    nan = (float("nan"), float("nan"))
    interactive = ClassFigures(100, 100, round(attainment * 100), 0, 0, nan, nan, 10.0)
    batch = ClassFigures(10, 10, 10, 0, 0, nan, nan, batch_tokens_per_s)
    return PolicyRun(policy, {"interactive": interactive, "batch": batch}, goodput=1.0, decode_hops={}, decode_cost=5.0)


def test_the_verdict_states_attainment_and_batch_throughput_against_each_baseline():
    lines = verdict([_run("service_class", 0.97, 90.0), _run("least_loaded", 0.8, 120.0), _run("round_robin", 0.5, 100.0)])
    assert lines[0] == "  service_class: interactive attainment 97.0% (target >= 95%)"
    assert lines[1].startswith("  vs round_robin: batch tokens/s 0.90x (target >= 0.90x)") and "97.0% vs 50.0%" in lines[1]
    assert lines[2].startswith("  vs least_loaded: batch tokens/s 0.75x,") and "97.0% vs 80.0%" in lines[2]
    assert len(verdict([_run("service_class", 0.97, 90.0)])) == 1  # baselines not run: nothing to compare
