"""The front-end benchmark's pieces: the engine that skips its forward pass keeps the engine's contract,
and `python -m disagg.bench front` measures every path on a real tritonserver."""
from __future__ import annotations

import json
import math
import os
import re
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from engine_helpers import EngineFactory

from disagg.bench.front import (COALESCED, PATHS, PROMPT, CeilingRound, Driver, Flight, Level, figure, front_spec, measure, median_interval,
                                perf_level, rotated, summary)
from disagg.bench.perf_load import Exported, PerfRun, read_export
from disagg.bench.first_token_trace import SEGMENTS
from disagg.bench.front_plot import plot
from disagg.engine.engine import ContextPhase, LLMEngine, Request
from disagg.engine.no_compute import skipped_compute
from disagg.engine.sampling import NO_END_ID
from disagg.repository import parse_config

ROOT = Path(__file__).resolve().parent.parent


def _expected(last: int, n: int, vocab: int) -> list[int]:
    out = []
    for _ in range(n):
        last = (last * 31 + 7) % vocab
        out.append(last)
    return out


def test_skipped_compute_follows_its_rule_frees_its_blocks_and_hands_off_like_the_engine(tmp_path):
    factory = EngineFactory(tmp_path)
    agg = LLMEngine(factory.engine_dir(), skip_compute=True)
    vocab = agg.config.model.vocab_size
    prompt = (5, 77, 300)
    got = agg.generate([Request("a", prompt, 12, end_id=NO_END_ID)])["a"]
    assert got == _expected(300, 12, vocab)
    assert agg.blocks.num_used == 0
    prefill = LLMEngine(factory.engine_dir(role="prefill"), skip_compute=True)
    decode = LLMEngine(factory.engine_dir(role="decode"), skip_compute=True)
    first = prefill.generate([Request("d", prompt, 12, "context_only", end_id=NO_END_ID)])["d"]
    ctx = ContextPhase(first[0], prefill.export_kv("d"))
    assert prefill.release("d")
    tokens = decode.generate([Request("d", prompt, 12, "generation_only", end_id=NO_END_ID, context=ctx)])["d"]
    assert tokens == got  # starts with the context phase's token again, as a generation-only request does
    assert prefill.blocks.num_used == 0 and decode.blocks.num_used == 0


def test_time_per_token_counts_every_token_of_a_coalesced_response():
    flight = Flight(sent=0.0, phase="text", stamps=[0.010, 0.011, 0.012, 0.015], counts=[1, 1, 3, 1])
    assert flight.per_token_s() == pytest.approx(0.005 / 5)  # 5 tokens after the first response
    assert Flight(sent=0.0, phase="text", stamps=[0.010], counts=[1]).per_token_s() is None


def test_a_perf_analyzer_row_counts_the_tokens_of_the_window_in_which_every_stream_was_busy():
    """Two streams: requests sent at 0 and 0, one at 0.6 answered with nothing, one at 1 s: both streams are in
    flight from 0 to 1 s. A response carrying no token (the final) is no response of the row's, one carrying
    three counts three."""
    run = PerfRun([Exported(0.0, (0.1, 0.3, 0.5, 0.6), (1, 1, 1, 0)), Exported(0.0, (0.2, 0.4, 1.5), (1, 3, 1)),
                   Exported(0.6, (), ()), Exported(1.0, (1.1, 1.2), (1, 1))], cpu_s=0.5)
    row = perf_level("tensorrt_llm_bls", 2, run, {"tritonserver": 0.9})
    assert row.tokens_per_s == pytest.approx(7 / 1.0)  # 1.1 and 1.2 came after the window, 1.5 too
    assert (row.completed, row.errors, row.client) == (3, 1, "perf_analyzer")
    assert row.ttft_ms == pytest.approx(100.0)  # 100, 200 and 100 ms
    assert row.gap_ms == pytest.approx(200.0)  # each request's mean gap between its token responses: 200, 650, 100
    assert row.token_ms == pytest.approx(200.0)  # after the first response: 400 / 2 = 200, 1300 / 4 = 325, 100
    assert row.cpu_ms_per_token == pytest.approx({"tritonserver": 900 / 10, "perf_analyzer": 500 / 10})  # 10 tokens in all


def test_perf_analyzer_s_window_ends_when_a_stream_is_no_longer_refilled():
    """perf_analyzer splits its requests among its threads, and a thread whose share is sent stops refilling its
    streams: three streams, refilled at 1 and 2 s, not at 3."""
    ended = [Exported(0.0, (1.0,), (1,)), Exported(0.0, (2.0,), (1,)), Exported(0.0, (3.0,), (1,)),
             Exported(1.0, (4.0,), (1,)), Exported(2.0, (5.0,), (1,))]
    assert PerfRun(ended, 0.0).window(3) == (0.0, 2.0)
    assert PerfRun(ended, 0.0).window(4) == (0.0, 2.0)  # never that many: the first request sent to the last
    doc = {"experiments": [{"requests": [{"timestamp": 2_000_000_000, "response_timestamps": [2_500_000_000, 3_000_000_000],
                                          "response_outputs": [{"num_output_tokens": 2}, {}]}]}]}
    assert read_export(doc, "text") == [Exported(2.0, (2.5, 3.0), (2, 0))]  # an output missing counts no token


@pytest.mark.e2e
def test_the_front_bench_measures_every_path_without_errors(tmp_path, capsys):
    peaks = iter([{16: 100.0, 64: 200.0}, {16: 300.0, 64: 150.0}])  # the computing engine's turn in each ceiling round
    rows, ceilings = measure(ROOT / "configs/cpu-tiny.yaml", tmp_path / "front", (2,), 1.0, 16, ceiling_rounds=2,
                             engine_peak=lambda: next(peaks), coalesced_bls=3, alternate=1)
    rounds = [r for r in rows if r.round is not None]
    perf_rows = [r for r in rows if r.client == "perf_analyzer"]
    rows = [r for r in rows if r.round is None and r.client == "python"]
    assert [r.path for r in rows] == [*PATHS, COALESCED]
    assert sorted(r.path for r in rounds) == sorted([*PATHS, COALESCED, "front_floor"]) and all(r.completed == 1 for r in rounds)
    # each front's model timed its requests of the round (the warm-up and the one measured) to their first engine request
    printed = capsys.readouterr().out
    for path in ("ensemble", "tensorrt_llm_bls", "aggregated", COALESCED):
        p50, mean = map(float, re.search(rf"[:,] {path} p50 ([0-9.]+) ms \(mean ([0-9.]+), 2 requests\)", printed).groups())
        assert 0 < p50 < 50 and 0 < mean < 50, printed
    # the coalescing BLS is the repository's own, its coalesce_backlog set
    config = parse_config(COALESCED, (tmp_path / "front/model_repository" / COALESCED / "config.pbtxt").read_text())
    assert config.parameters["coalesce_backlog"].string_value == "3" and config.parameters["mode"].string_value == "disaggregated"
    # perf_analyzer drives each path of the ceiling rounds once per level first, then in each round at its best
    # level, beside that round's engine timing; its bound is an engine called directly
    fronts = ["ensemble", "tensorrt_llm_bls", COALESCED, "aggregated_engine"]
    assert [(r.path, r.streams) for r in perf_rows] == [(path, 2) for path in PATHS + (COALESCED,) if path in fronts]
    assert [(c.round, c.engine, list(c.fronts)) for c in ceilings] == [
        (0, {16: 100.0, 64: 200.0}, fronts), (1, {16: 300.0, 64: 150.0}, fronts)]
    for level in perf_rows + [level for c in ceilings for level in c.fronts.values()]:
        assert level.client == "perf_analyzer" and level.streams == 2 and level.errors == 0 and level.tokens_per_s > 0, level
        assert level.completed >= 4 and level.cpu_ms_per_token["perf_analyzer"] > 0 and level.cpu_ms_per_token["tritonserver"] > 0, level
    for c in ceilings:
        for front, level in c.fronts.items():
            assert level.path == front and c.ratio(front) == level.tokens_per_s / max(c.engine.values())
    # every request perf_analyzer sent streamed its 16 tokens, counted from each response's own count: a token per
    # response but where the coalescing BLS merged those waiting
    for front in fronts:
        exported = read_export(json.loads((tmp_path / "front/perf_analyzer" / f"{front}-c2.json").read_text()),
                               "engine" if front == "aggregated_engine" else "text")
        assert exported and all(sum(r.tokens) == 16 for r in exported), front
        assert front == COALESCED or all(r.tokens.count(1) == 16 for r in exported), front
    for r in rows:
        assert r.errors == 0 and r.completed > 0 and r.tokens_per_s > 0, r
        assert 0 < r.ttft_ms < 1000 and r.gap_ms > 0, r
        if r.path != COALESCED:
            assert r.token_ms == pytest.approx(r.gap_ms), r  # one token per response: no coalescing here
    # CPU per token is attributed to the processes that spent it: the ensemble's front models only on the
    # paths that go through them.
    by = {r.path: r.cpu_ms_per_token for r in rows}
    for path in PATHS:
        assert by[path]["tritonserver"] > 0 and by[path]["client"] > 0, by[path]
    assert by["ensemble"]["stub disagg_orchestrator"] > 0.05 and by["ensemble"]["stub postprocessing"] > 0.05, by["ensemble"]
    assert by["ensemble"]["stub decode"] > 0.01
    assert by["prefill + decode"]["stub disagg_orchestrator"] < 0.2 * by["ensemble"]["stub disagg_orchestrator"], by
    assert by["prefill + decode"]["stub postprocessing"] < 0.2 * by["ensemble"]["stub postprocessing"], by
    assert by[COALESCED][f"stub {COALESCED}"] > 0.05 and by[COALESCED]["stub tensorrt_llm_bls"] < 0.2 * by[COALESCED][f"stub {COALESCED}"], by
    assert by["aggregated"]["stub aggregated_orchestrator"] > 0.05 and by["aggregated"]["stub aggregated_engine"] > 0.01, by["aggregated"]


@pytest.mark.e2e
def test_a_row_runs_until_its_minimum_of_requests_and_counts_its_rate_over_the_whole_window(tmp_path, capsys):
    """One stream with 20 ms steps: a 16-token request takes about 0.33 s, so a 0.01 s window would hold one. Triton
    traces the alternated rounds (`trace`)."""
    (row, *rounds), ceilings = measure(ROOT / "configs/cpu-tiny.yaml", tmp_path / "front", (1,), 0.01, 16, step_ms=20.0,
                                       paths=("prefill + decode",), min_requests=6, alternate=3, trace=True)
    assert ceilings == []
    assert row.errors == 0 and 6 <= row.completed <= 7, row
    # each round: one request on each path and on front_floor, the first path rotating
    assert [(r.path, r.round, r.completed) for r in rounds] == [
        ("prefill + decode", 0, 1), ("front_floor", 0, 1), ("front_floor", 1, 1), ("prefill + decode", 1, 1),
        ("prefill + decode", 2, 1), ("front_floor", 2, 1)]
    assert all(19 < r.ttft_ms < 60 and r.errors == 0 for r in rounds), rounds  # one request each: its own prefill step
    assert all(19 < r.idle_ttft_ms < 60 for r in rounds), rounds  # after the warm-up before it, measured apart
    assert math.isnan(row.idle_ttft_ms)  # a level has no warm-up
    assert all(math.isnan(r.token_ms) for r in rounds if r.path == "front_floor")  # the first token, no more
    assert "front_floor vs prefill + decode, one request at a time, alternated (3 rounds): TTFT " in "\n".join(summary([row, *rounds], []))
    assert 35 < row.tokens_per_s < 52, row  # one token per 20 ms step and a little more, over the window it ran
    assert 19 < row.gap_ms < 30, row
    # each measured request of the rounds, split at Triton's stamps (the warm-ups and the level's requests were not
    # traced): the engine's part is its 20 ms step, each of the rest a fraction of it, and they add up to the TTFT
    # the client saw (the same clock)
    found = json.loads((tmp_path / "front/first_token.json").read_text())
    assert {path: [list(s) for s in segments] for path, segments in found.items()} == {
        "prefill + decode": [["client to server", "server in", "engine", "server out", "server to client"]] * 3,
        "front_floor": [list(SEGMENTS)] * 3}
    for path, segments in found.items():
        assert all(19 < s["engine"] < 60 for s in segments), segments
        assert all(0 <= v < 10 for s in segments for name, v in s.items() if name != "engine"), segments
        ttfts = sorted(r.ttft_ms for r in rounds if r.path == path)
        assert sorted(sum(s.values()) for s in segments) == pytest.approx(ttfts, abs=1e-3), (segments, ttfts)
    assert "where the first token's time goes (Triton's request traces of the alternated rounds" in capsys.readouterr().out


def test_the_driver_lets_go_of_a_server_that_stopped_answering(tmp_path):
    """A crashed tritonserver can deadlock in its signal handler, alive and silent (README, Known problems).
    The bench's client must then cancel its stream, not wait for the server to end it: it did wait, for
    good, after such a crash in a 256-stream run."""
    from disagg.cli import build
    from disagg.serve.server import TritonServer
    from disagg.text import encode_prompt, load_tokenizer

    spec = front_spec(ROOT / "configs/cpu-tiny.yaml", tmp_path / "front", 2)
    build(spec, log=lambda _line: None)
    ids = encode_prompt(load_tokenizer(spec.model.path), PROMPT)
    with skipped_compute(20.0), TritonServer(spec.model_repository, log_path=tmp_path / "server.log") as server:
        driver = Driver(server.grpc_url, server.internal_key, ids, 200, server.process.pid)
        with driver._lock:  # one request of 200 tokens at 20 ms a step: 4 s of streaming
            driver._reset("aggregated_engine", time.perf_counter() + 60)
            driver._send_new(time.perf_counter())
        deadline = time.monotonic() + 30
        while not any(f.stamps for f in driver.flights.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(f.stamps for f in driver.flights.values()), "no token streamed"
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            closing = threading.Thread(target=driver.close, daemon=True)
            started = time.monotonic()
            closing.start()
            closing.join(10)
            assert not closing.is_alive(), "the driver waited on a server that no longer answers"
            assert time.monotonic() - started < 5
            assert driver.errors == 1 and not driver.flights  # cut off mid-answer, counted as failed, nothing sent after
        finally:
            os.kill(server.process.pid, signal.SIGCONT)


def test_rounds_rotate_which_path_goes_first():
    assert [rotated(("a", "b", "c"), i) for i in range(4)] == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]


def test_the_median_of_the_rounds_comes_with_how_far_it_can_be_trusted():
    low, high = median_interval([float(x) for x in range(21)])  # median 10, standard error about 1.7
    assert 5.0 <= low <= 8.0 and 12.0 <= high <= 15.0, (low, high)  # the quartiles: 5 and 15
    assert median_interval([3.0] * 20) == (3.0, 3.0)
    assert median_interval([float(x) for x in range(21)]) == (low, high)  # the same rounds print the same


def test_the_front_ceiling_is_given_per_round_against_the_engine_timed_in_that_round():
    rows = [Level("tensorrt_llm_bls", 64, 1200.0, 200.0, 40.0, 40.0, 700, 0, {"tritonserver": 0.3, "stub tensorrt_llm_bls": 0.4}),
            Level("prefill + decode", 64, 2400.0, 60.0, 21.0, 21.0, 1400, 0, {"tritonserver": 0.2})]
    served = [(400.0, 1200.0, 1000.0, 2000.0), (600.0, 1500.0, 900.0, 2500.0), (300.0, 1050.0, 600.0, 1500.0)]  # engine, BLS, ensemble, direct
    ceilings = [CeilingRound(i, {16: engine / 2, 64: engine},
                             {"tensorrt_llm_bls": replace(rows[0], tokens_per_s=bls), "ensemble": replace(rows[0], path="ensemble", tokens_per_s=ens),
                              "prefill + decode": replace(rows[1], tokens_per_s=direct)})
                for i, (engine, bls, ens, direct) in enumerate(served)]
    lines = summary(rows, ceilings)
    start = lines.index("  the computing decode engine's best tokens/s by round (bench-100mb, batch 16 or 64): 400, 600, 300; "
                        "the paths' load driven by python")
    assert lines[start + 1:start + 4] == [
        "  front ceiling (ensemble, 64 streams) / the computing decode engine's best, 3 rounds: median 2.00x (1.50x to 2.50x; "
        "by round 2.50x, 1.50x, 2.00x), the front serving 900 tokens/s (median); 0 of 3 rounds at 3x or more; "
        "0.40 of the engines called directly (prefill + decode) in the same round (median)",
        "  front ceiling (tensorrt_llm_bls, 64 streams) / the computing decode engine's best, 3 rounds: median 3.00x (2.50x to 3.50x; "
        "by round 3.00x, 2.50x, 3.50x), the front serving 1200 tokens/s (median); 2 of 3 rounds at 3x or more; "
        "0.60 of the engines called directly (prefill + decode) in the same round (median)",
        "  without a front (prefill + decode, 64 streams) / the computing decode engine's best, 3 rounds: median 5.00x (4.17x to 5.00x; "
        "by round 5.00x, 4.17x, 5.00x), serving 2000 tokens/s (median); 3 of 3 rounds at 3x or more"]
    assert lines[start + 4:] == [
        "  against the targets (one request at a time after one on the same path, the medians of the alternated rounds against "
        "prefill + decode: "
        "TTFT added <= 1.5 ms, per token <= 0.1 ms; every ceiling round at 3x or more):",
        "    ensemble                    ceiling at 3x in 0 of 3 rounds (not met)",
        "    tensorrt_llm_bls            ceiling at 3x in 2 of 3 rounds (not met)",
        "  bounds on this machine: the engines called directly (prefill + decode) serve 4.17x to 5.00x the computing decode engine's peak"]
    # perf_analyzer's rows, the levels it chose from, are no rows of the Driver's comparisons
    assert summary(rows + [replace(rows[0], tokens_per_s=9999.0, client="perf_analyzer")], ceilings) == summary(rows, ceilings)
    # under perf_analyzer the bound is an engine called directly, one request each
    by_perf = [CeilingRound(c.round, c.engine, {("aggregated_engine" if f == "prefill + decode" else f):
                                                replace(level, client="perf_analyzer") for f, level in c.fronts.items()})
               for c in ceilings]
    lines = summary(rows, by_perf)
    start = lines.index("  the computing decode engine's best tokens/s by round (bench-100mb, batch 16 or 64): 400, 600, 300; "
                        "the paths' load driven by perf_analyzer")
    assert lines[start + 2].endswith("2 of 3 rounds at 3x or more; 0.60 of the engines called directly (aggregated_engine) in the same round (median)")
    assert lines[start + 3].startswith("  without a front (aggregated_engine, 64 streams) / the computing decode engine's best, 3 rounds: median 5.00x")
    assert lines[-1] == "  bounds on this machine: the engines called directly (aggregated_engine) serve 4.17x to 5.00x the computing decode engine's peak"
    lines = summary(rows, [])
    assert lines[0] == "  tensorrt_llm_bls / prefill + decode tokens/s by streams: 64: 0.50"  # no line for a path not measured
    rounds = [Level(path, 1, 0.0, ttft, 21.0, token, 1, 0, round=i) for i, (path, ttft, token) in enumerate(
        [("tensorrt_llm_bls", 30.0, 21.1), ("prefill + decode", 26.0, 21.0), ("tensorrt_llm_bls", 27.0, 21.0),
         ("prefill + decode", 26.0, 21.0), ("tensorrt_llm_bls", 29.0, 21.3)])]
    rounds = [replace(r, round=i // 2) for i, r in enumerate(rounds)]  # rounds 0, 0, 1, 1, 2: round 2 has no pair
    lines = summary(rows + rounds, [])
    assert lines[1] == ("  tensorrt_llm_bls vs prefill + decode, one request at a time, alternated (2 rounds): TTFT +2.50 ms "
                        "(median within +1.00 to +4.00 at 95%; quartiles +1.75 to +3.25), per token +0.050 ms (+0.025 to +0.075)")
    cpu = next(i for i, line in enumerate(lines) if line.startswith("  CPU ms per output token"))
    assert lines[cpu + 2].startswith("    prefill + decode            total 0.20")  # the rounds are no level: the CPU is the 64 streams'
    assert lines[-1] == ("    tensorrt_llm_bls            TTFT +2.50 ms (not met by the median; its 95% interval +1.00 to +4.00 holds the "
                         "target); per token +0.050 ms (met by the median; its 95% interval +0.000 to +0.100 holds the target)")  # no bound measured
    clear = [replace(r, ttft_ms=r.ttft_ms + (1.0 if r.path == "tensorrt_llm_bls" else 0.0), token_ms=21.0) for r in rounds]
    assert summary(rows + clear, [])[-1] == "    tensorrt_llm_bls            TTFT +3.50 ms (not met); per token +0.000 ms (met)"
    floor = [Level("front_floor", 1, 0.0, ttft, 0.0, float("nan"), 1, 0, round=i) for i, ttft in ((0, 27.5), (1, 26.25))]
    lines = summary(rows + rounds + floor, [])
    idle = [replace(r, idle_ttft_ms=r.ttft_ms + (2.0 if r.path == "tensorrt_llm_bls" else 0.5)) for r in rounds]
    assert summary(rows + idle, [])[1].endswith("per token +0.050 ms (+0.025 to +0.075); after idling, TTFT +4.00 ms (+2.50 to +5.50)")
    assert lines[2:4] == ["  front_floor vs prefill + decode, one request at a time, alternated (2 rounds): TTFT +0.88 ms "
                          "(median within +0.25 to +1.50 at 95%; quartiles +0.56 to +1.19)",
                          "  tensorrt_llm_bls vs front_floor, one request at a time, alternated (2 rounds): TTFT +1.62 ms "
                          "(median within +0.75 to +2.50 at 95%; quartiles +1.19 to +2.06)"]  # front_floor has no time per token
    assert lines[-1] == "  bounds on this machine: front_floor adds +0.88 ms of TTFT"
    one = [Level("tensorrt_llm_bls", 1, 48.0, 28.93, 20.945, 20.945, 21, 0), Level("prefill + decode", 1, 48.0, 24.94, 21.0, 21.0, 22, 0)]
    assert summary(one, [])[0] == ("  tensorrt_llm_bls vs prefill + decode, 1 stream: TTFT +3.99 ms, per token "
                                   "-0.055 ms, gap between responses -0.055 ms (21 and 22 requests)")


def test_the_figure_shows_each_path_by_streams_each_ceiling_round_and_each_round_of_ttft(tmp_path):
    rows = [Level(path, streams, rate, 30.0, 21.0, 21.0, 10, 0) for path, streams, rate in (
        ("tensorrt_llm_bls", 1, 45.0), ("tensorrt_llm_bls", 64, 1200.0), ("prefill + decode", 1, 48.0), ("prefill + decode", 64, 2400.0))]
    ceilings = [CeilingRound(i, {16: 200.0, 64: engine}, {"tensorrt_llm_bls": replace(rows[1], tokens_per_s=bls),
                                                         "prefill + decode": replace(rows[3], tokens_per_s=direct)})
                for i, (engine, bls, direct) in enumerate([(400.0, 1000.0, 2000.0), (500.0, 1600.0, 2500.0)])]
    rounds = [Level(path, 1, 0.0, ttft, 21.0, 21.0, 1, 0, round=i) for i, path, ttft in (
        (0, "tensorrt_llm_bls", 27.5), (0, "prefill + decode", 26.0), (0, "front_floor", 27.0),
        (1, "prefill + decode", 25.0), (1, "tensorrt_llm_bls", 27.0), (1, "front_floor", 26.0))]
    shown = figure(rows + rounds + [replace(rows[1], streams=256, client="perf_analyzer")], ceilings)
    assert shown.tokens == {"tensorrt_llm_bls": [(1, 45.0), (64, 1200.0)], "prefill + decode": [(1, 48.0), (64, 2400.0)]}  # the Driver's
    assert shown.engine_peaks == [400.0, 500.0]
    assert shown.ratios == {"tensorrt_llm_bls": [2.5, 3.2], "prefill + decode": [5.0, 5.0]}
    assert shown.ttft_added == {"ensemble": [], "tensorrt_llm_bls": [1.5, 2.0], COALESCED: [], "front_floor": [1.0, 1.0]}
    assert (shown.ceiling_target, shown.ttft_target_ms, shown.ceiling_client) == (3.0, 1.5, "python")
    drawn = plot(shown, tmp_path / "front.png")
    assert drawn.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bare = figure(rows, [])  # no ceiling rounds, no alternated rounds: the levels alone
    assert (bare.engine_peaks, bare.ratios, set(map(len, bare.ttft_added.values())), bare.ceiling_client) == ([], {}, {0}, "")
    assert plot(bare, tmp_path / "bare.png").stat().st_size > 0


@pytest.mark.parametrize("command, flag", [("front", "--ceiling-rounds"), ("sla", "--seconds"), ("clients", "--genai-perf")])
def test_a_bench_commands_help_is_its_own(command, flag, capsys):
    """`python -m disagg.bench <command> --help` prints that command's options, not only the list of commands."""
    from disagg.bench.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m disagg.bench {command} ") and flag in out


def test_trace_without_alternated_rounds_is_refused_before_any_work(tmp_path, capsys):
    from disagg.bench.front import main

    with pytest.raises(SystemExit) as exited:
        main(["--trace", "--alternate", "0", "--out", str(tmp_path / "front")])
    assert exited.value.code == 2
    assert "--trace traces the alternated rounds: give --alternate 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "front").exists()
