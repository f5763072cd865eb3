"""Service-level routing below the model boundary: the speed a pool is measured at, and where a class goes."""
from __future__ import annotations

import pytest

from disagg.triton import sla
from disagg.triton.sla import NoPoolMeets, Option, ServiceClass, Speed, choose, parse_classes

INTERACTIVE = ServiceClass("interactive", ttft_s=0.5, tpot_s=0.05)
BATCH = ServiceClass("batch")


def _speed(*seen: tuple[int, float]) -> Speed:
    speed = Speed()
    for n, seconds in seen:
        speed.observe(n, seconds)
    return speed


def test_classes_come_from_the_orchestrators_parameter_in_seconds():
    assert parse_classes('{"interactive": {"ttft_ms": 500, "tpot_ms": 50}, "batch": {"ttft_ms": null, "tpot_ms": null}}') == {
        "interactive": INTERACTIVE, "batch": BATCH}
    assert parse_classes("{}") == {} and parse_classes("") == {}


def test_a_pools_speed_is_fitted_against_its_load_once_it_has_enough_hops():
    assert _speed((1, 0.02), (2, 0.03)).predict(1) is None  # fewer than MIN_SAMPLES: unknown
    assert _speed((1, 0.02), (1, 0.02), (1, 0.05)).predict(8) == pytest.approx(0.03)  # one load seen: the mean
    linear = _speed((1, 0.02), (2, 0.03), (3, 0.04), (5, 0.06))
    assert linear.predict(9) == pytest.approx(0.10)
    assert _speed((1, 0.05), (2, 0.04), (3, 0.03)).predict(10) == pytest.approx(0.04)  # never faster when busier


def _options() -> tuple[list[Option], dict[str, Speed]]:
    fast = _speed(*[(n, 0.01 * n) for n in (1, 2, 3, 4)])  # 10 ms per token per request in flight
    slow = _speed(*[(n, 0.04 * n) for n in (1, 2, 3, 4)])
    options = [Option("fast-1", "fast", 3.0, 3, (False, 3, 0)), Option("slow-1", "slow", 1.0, 0, (False, 0, 0))]
    return options, {"fast": fast, "slow": slow}


def test_a_class_goes_to_the_cheapest_pool_predicted_to_meet_it():
    options, speeds = _options()
    assert choose(options, speeds, INTERACTIVE, "decode", 0.05).key == "slow-1"  # 40 ms: meets 50, and cheaper
    busy = [options[0], Option("slow-1", "slow", 1.0, 2, (False, 2, 0))]  # slow would now take 120 ms
    assert choose(busy, speeds, INTERACTIVE, "decode", 0.05).key == "fast-1"  # 40 ms on the dearer pool


def test_no_pool_meeting_the_class_is_a_retryable_refusal_naming_the_best():
    options, speeds = _options()
    options[0] = Option("fast-1", "fast", 3.0, 4, (False, 4, 0))  # 50 ms there now; slow 40 ms
    tight = ServiceClass("realtime", tpot_s=0.005)
    with pytest.raises(NoPoolMeets, match=r"^service class 'realtime': no decode pool is predicted to meet its time per output "
                                          r"token of 5 ms now \(best: 40 ms on slow\): retry shortly$"):
        choose(options, speeds, tight, "decode", 0.005)


def test_an_unmeasured_pool_is_tried():
    options, speeds = _options()
    new = Option("new-1", "new", 9.0, 0, (False, 0, 0))
    assert choose([new], speeds, ServiceClass("realtime", tpot_s=0.001), "decode", 0.001).key == "new-1"


def test_a_class_without_targets_takes_the_least_loaded_but_leaves_headroom_for_a_stricter_one():
    _, speeds = _options()
    assert sla.HEADROOM == 2
    # fast holds 3 and is the less loaded; with 1 + HEADROOM more it would take 60 ms > the strictest 50 ms
    options = [Option("fast-1", "fast", 3.0, 3, (False, 0, 0)), Option("slow-1", "slow", 1.0, 0, (False, 1, 0))]
    assert choose(options, {"fast": speeds["fast"]}, BATCH, "decode", 0.05).key == "slow-1"  # slow: unmeasured, so spare
    assert choose(options, speeds, BATCH, "decode", 0.05).key == "fast-1"  # neither has room: the least loaded
    assert choose(options, {"fast": speeds["fast"]}, BATCH, "decode", None).key == "fast-1"  # no stricter class
