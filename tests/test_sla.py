"""Service-level routing below the model boundary: the speed a pool is measured at, and where a class goes."""
from __future__ import annotations

import pytest

from disagg.triton import sla
from disagg.triton.sla import NoPoolMeets, Option, Phase, ServiceClass, Speed, choose, parse_classes

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
    # One load seen: the mean, plus Z standard deviations of the hops around it (here sqrt(0.0006/2) s).
    assert _speed((1, 0.02), (1, 0.02), (1, 0.05)).predict(8) == pytest.approx(0.03 + sla.Z * 0.0173205, abs=1e-6)
    linear = _speed((1, 0.02), (2, 0.03), (3, 0.04), (5, 0.06))
    assert linear.predict(9) == pytest.approx(0.10)
    # Never faster when busier: a flat line at the mean, the hops 10 ms either side of it.
    assert _speed((1, 0.05), (2, 0.04), (3, 0.03)).predict(10) == pytest.approx(0.04 + sla.Z * 0.01)
    # seen only busy, and steep: below the loads seen the line is not followed down to zero
    assert _speed((4, 0.02), (5, 0.06), (6, 0.10)).predict(1) == pytest.approx(0.02)


def _options() -> tuple[list[Option], dict[str, Speed]]:
    fast = _speed(*[(n, 0.01 * n) for n in (1, 2, 3, 4)])  # 10 ms per token per request in flight
    slow = _speed(*[(n, 0.04 * n) for n in (1, 2, 3, 4)])
    options = [Option("fast-1", "fast", 3.0, 3, (False, 3, 0)), Option("slow-1", "slow", 1.0, 0, (False, 0, 0))]
    return options, {"fast": fast, "slow": slow}


def test_a_class_goes_to_the_cheapest_pool_predicted_to_meet_it():
    options, speeds = _options()
    assert choose(options, INTERACTIVE, [Phase("decode", speeds, 0.05)], "decode").key == "slow-1"  # 40 ms: meets 50, and cheaper
    busy = [options[0], Option("slow-1", "slow", 1.0, 2, (False, 2, 0))]  # slow would now take 120 ms
    assert choose(busy, INTERACTIVE, [Phase("decode", speeds, 0.05)], "decode").key == "fast-1"  # 40 ms on the dearer pool


def test_no_pool_meeting_the_class_is_a_retryable_refusal_naming_the_best():
    options, speeds = _options()
    options[0] = Option("fast-1", "fast", 3.0, 4, (False, 4, 0))  # 50 ms there now; slow 40 ms
    tight = ServiceClass("realtime", tpot_s=0.005)
    with pytest.raises(NoPoolMeets, match=r"^service class 'realtime': no decode pool is predicted to meet its time per output "
                                          r"token of 5 ms now \(best: 40 ms on slow\): retry shortly$"):
        choose(options, tight, [Phase("decode", speeds, 0.005)], "decode")


def test_an_unmeasured_pool_is_tried_one_hop_at_a_time_unless_no_measured_pool_meets_the_class():
    options, speeds = _options()  # fast meets interactive's 50 ms at 3 in flight (40 ms)
    decode = [Phase("decode", speeds, 0.05)]
    idle, busy = Option("new-1", "new", 0.5, 0, (False, 0, 0)), Option("new-1", "new", 0.5, 2, (False, 2, 0))
    assert choose([options[0], idle], INTERACTIVE, decode, "decode").key == "new-1"  # cheapest, and free to be tried
    assert choose([options[0], busy], INTERACTIVE, decode, "decode").key == "fast-1"  # being tried: the measured pool meets
    realtime = ServiceClass("realtime", tpot_s=0.001)  # no measured pool meets it: the unmeasured one, busy or not
    assert choose([options[0], busy], realtime, [Phase("decode", speeds, 0.001)], "decode").key == "new-1"


def test_a_class_without_targets_takes_the_least_loaded_but_leaves_headroom_for_a_stricter_one():
    _, speeds = _options()
    assert sla.HEADROOM == 2
    # fast holds 3 and is the less loaded; with 1 + HEADROOM more it would take 60 ms > the strictest 50 ms
    options = [Option("fast-1", "fast", 3.0, 3, (False, 0, 0)), Option("slow-1", "slow", 1.0, 0, (False, 1, 0))]
    assert choose(options, BATCH, [Phase("decode", {"fast": speeds["fast"]}, 0.05)], "decode").key == "slow-1"  # slow: unmeasured, so spare
    assert choose(options, BATCH, [Phase("decode", speeds, 0.05)], "decode").key == "fast-1"  # neither has room: the least loaded
    assert choose(options, BATCH, [Phase("decode", {"fast": speeds["fast"]}, None)], "decode").key == "fast-1"  # no stricter class
    # slow, busier, cannot meet 50 ms anyway (120 ms at 3 in flight): spare, so batch goes there and fast
    # keeps its room for the stricter class
    busy_slow = [options[0], Option("slow-1", "slow", 1.0, 2, (False, 5, 0))]
    assert choose(busy_slow, BATCH, [Phase("decode", speeds, 0.05)], "decode").key == "slow-1"


def test_an_aggregated_hop_goes_where_both_its_ttft_and_tpot_are_met_and_a_refusal_names_what_fails():
    options, tpot = _options()  # fast: 40 ms per token at 4 in flight, slow: 40 ms at 1
    ttft = {"fast": _speed(*[(n, 0.1 * n) for n in (1, 2, 3, 4)]), "slow": _speed(*[(n, 1.0 * n) for n in (1, 2, 3, 4)])}
    phases = [Phase("prefill", ttft, 0.5), Phase("decode", tpot, 0.05)]
    # slow is cheaper and meets the TPOT (40 ms) but not the TTFT (1 s at 1 in flight): fast (400 ms, 40 ms)
    assert choose(options, INTERACTIVE, phases, "aggregated").key == "fast-1"
    with pytest.raises(NoPoolMeets, match=r"^service class 'quick': no aggregated pool is predicted to meet its time to first token "
                                          r"of 200 ms now \(best: 400 ms on fast\): retry shortly$"):
        choose(options, ServiceClass("quick", ttft_s=0.2, tpot_s=0.05), phases, "aggregated")
    # fast, busier, meets only the TTFT (500 ms, 50 ms), slow only the TPOT (1 s, 40 ms): neither meets both
    busier = [Option("fast-1", "fast", 3.0, 4, (False, 4, 0)), options[1]]
    with pytest.raises(NoPoolMeets, match=r"^service class 'both': no aggregated pool is predicted to meet both its time to first "
                                          r"token of 500 ms and time per output token of 45 ms now: retry shortly$"):
        choose(busier, ServiceClass("both", ttft_s=0.5, tpot_s=0.045), phases, "aggregated")
