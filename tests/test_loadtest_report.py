"""loadtest/report.py and samples.py on fixed synthetic samples: definitions, exact numbers, files."""
from __future__ import annotations

import csv
import json

import pytest

from loadtest.metrics_sampler import MetricsSeries
from loadtest.report import Slo, format_table, goodput, group_runs, headline, percentiles, run_stats, write_report
from loadtest.samples import Sample, read_samples

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sample(ttft: float, gaps: list[float], *, model: str = "ensemble", rate: float | None = None, t0: float = 100.0,
           tail: float = 0.0, chars: list[int] | None = None, error: str | None = None, index: int = 0,
           scheduled: float | None = None, tokens: list[int] | None = None) -> Sample:
    """A request sent at t0 whose chunks arrive at t0+ttft, then after each gap; the stream ends `tail` later."""
    times = [t0 + ttft]
    for gap in gaps:
        times.append(times[-1] + gap)
    if error is not None:
        times = []
    return Sample(
        model=model, index=index, prompt_tokens=10, max_tokens=len(times), shared_prefix=False, rate=rate, users=4,
        scheduled=scheduled, start_unix=0.0, t_send=t0, t_chunks=tuple(times),
        chunk_chars=tuple(chars or [3] * len(times)), t_end=(times[-1] if times else t0 + ttft) + tail, error=error,
        chunk_tokens=tuple(tokens or ()),
    )


def test_metric_definitions_on_one_request():
    # chunks at +0.1, +0.15 (empty: half a UTF-8 character), +0.2, +0.3; the stream ends at +0.35
    s = sample(0.1, [0.05, 0.05, 0.1], chars=[2, 0, 1, 4], tail=0.05)
    assert s.ttft == pytest.approx(0.1)
    assert s.n_out == 3 and s.chunk_count == 4  # the empty chunk is no token arrival
    assert s.itl == pytest.approx([0.1, 0.1])  # N_out - 1 gaps between non-empty chunks
    assert s.e2e == pytest.approx(0.35)
    assert s.tpot == pytest.approx((0.35 - 0.1) / 2)  # (E2E - TTFT) / (N_out - 1): not the mean ITL
    single = sample(0.2, [])
    assert single.tpot is None and single.itl == []


def test_empty_first_chunk_does_not_count_as_first_token():
    s = sample(0.1, [0.2], chars=[0, 5])
    assert s.ttft == pytest.approx(0.3) and s.n_out == 1


def test_the_server_s_token_counts_time_the_tokens_where_it_sends_them():
    # the same responses, counted by the server: the one with half a UTF-8 character carries a token, the third two
    s = sample(0.1, [0.05, 0.05, 0.1], chars=[2, 0, 1, 4], tail=0.05, tokens=[1, 1, 2, 1])
    assert s.ttft == pytest.approx(0.1) and s.n_out == 5
    assert s.itl == pytest.approx([0.05, 0.05, 0.1])  # a gap per response that carries tokens
    assert s.tpot == pytest.approx((0.35 - 0.1) / 4)
    # a stand-in's first token decodes to no text: its time is still the first token's
    late_text = sample(0.1, [0.2], chars=[0, 5], tokens=[1, 1])
    assert late_text.ttft == pytest.approx(0.1) and late_text.n_out == 2
    back = Sample.from_dict(json.loads(s.to_json()))
    assert back == s and Sample.from_dict({k: v for k, v in json.loads(s.to_json()).items() if k != "chunk_tokens"}).n_out == 3


def test_percentiles_are_exact_numpy_linear():
    p = percentiles([0.010, 0.020, 0.030, 0.040, 0.050])
    assert p["p50"] == pytest.approx(30.0)
    assert p["p95"] == pytest.approx(48.0)  # 40 + 0.8 * 10
    assert p["p99"] == pytest.approx(49.6)
    assert p["mean"] == pytest.approx(30.0)
    assert percentiles([]) == {"p50": None, "p95": None, "p99": None, "mean": None}


def test_run_stats_slo_attainment_and_request_goodput():
    slo = Slo(ttft_ms=100, tpot_ms=20)
    runs = [
        sample(0.05, [0.01] * 9, t0=0.0),  # meets both; ends at 0.14
        sample(0.15, [0.01] * 9, t0=1.0),  # TTFT miss
        sample(0.05, [0.03] * 9, t0=2.0),  # TPOT 30 ms: miss
        sample(0.05, [], t0=3.0),  # one token: TTFT only, meets
        sample(0.05, [], t0=3.5, error="in ensemble 'ensemble', boom"),  # error: miss
        sample(0.05, [0.01], t0=4.0, chars=[0, 0]),  # no text at all: miss, not an error
    ]
    r = run_stats(runs, slo)
    duration = (4.0 + 0.06) - 0.0
    assert r.requests == 6 and r.errors == 1 and r.no_text == 1
    assert r.duration_s == pytest.approx(duration)
    assert r.slo_attainment == pytest.approx(2 / 6)
    assert r.request_goodput == pytest.approx(2 / duration)
    assert r.requests_per_s == pytest.approx(5 / duration)
    assert r.output_tokens_per_s == pytest.approx((10 + 10 + 10 + 1) / duration)
    assert r.ttft_ms["p50"] == pytest.approx(50.0)  # 50, 50, 50, 150: the no-text request has no TTFT
    assert r.itl_ms["p50"] == pytest.approx(10.0)  # 27 gaps: 18 of 10 ms, 9 of 30 ms
    assert r.tpot_ms["p95"] == pytest.approx(28.0)  # 10, 10, 30: position 0.95 * 2 = 1.9 -> 10 + 0.9 * 20
    assert r.send_lag_p95_ms is None


def test_send_lag_is_measured_against_the_schedule():
    runs = [sample(0.05, [0.01], t0=10.0 + planned + late, rate=2.0, scheduled=planned, index=i)
            for i, (planned, late) in enumerate([(0.0, 0.0), (0.5, 0.0), (1.0, 0.2)])]
    assert run_stats(runs, Slo(100, 20)).send_lag_p95_ms == pytest.approx(180.0)  # 0, 0, 200 ms -> p95


def _sweep(attainments: dict[float, float], deployment_model: str) -> list[Sample]:
    """10 requests per rate, the first `attainment * 10` meeting TTFT <= 100 ms, the others not."""
    out = []
    for rate, attainment in attainments.items():
        for i in range(10):
            out.append(sample(0.05 if i < attainment * 10 else 0.5, [0.01] * 3, model=deployment_model, rate=rate,
                              t0=i * 0.1, scheduled=i * 0.1, index=i))
    return out


def test_goodput_is_the_highest_rate_before_attainment_drops_below_90_percent():
    samples = _sweep({1.0: 1.0, 2.0: 0.9, 4.0: 0.5}, "ensemble") + _sweep({1.0: 1.0, 2.0: 0.8, 4.0: 1.0}, "aggregated")
    stats = [run_stats(s, Slo(100, 50)) for s in group_runs(samples).values()]
    assert goodput(stats) == {"aggregated": 1.0, "disaggregated": 2.0}  # aggregated's 4 req/s is past a miss
    missing = [run_stats(s, Slo(10, 50)) for s in group_runs(_sweep({1.0: 1.0}, "ensemble")).values()]
    assert goodput(missing) == {"disaggregated": None}
    assert "disaggregated 2.00 vs aggregated 1.00 req/s -> disagg/agg 2.00x" in headline(stats, Slo(100, 50))[-1]


def test_table_puts_deployments_side_by_side_with_the_ratio():
    runs = [sample(0.04, [0.010] * 4, model="aggregated"), sample(0.02, [0.005] * 4, model="ensemble", t0=200.0)]
    stats = [run_stats(s, Slo(100, 50)) for s in group_runs(runs).values()]
    table = format_table(stats)
    header, ttft = table.splitlines()[1:3]
    assert header.split() == ["aggregated", "disaggregated", "disagg/agg"]
    assert ttft.split() == ["TTFT", "p50", "(ms)", "40.0", "20.0", "0.50"]
    line = headline(stats, Slo(100, 50))[0]
    assert "p95 ITL 0.50x (5.0 vs 10.0 ms)" in line and "p50 TTFT 0.50x (20.0 vs 40.0 ms)" in line


def test_metrics_summary_names_the_bottleneck_side():
    series = MetricsSeries(
        t=(0.0, 0.5, 1.0),
        series={
            "disagg_kv_blocks_in_use": {"decode": [10.0, 120.0, 30.0], "prefill": [0.0, 4.0, None]},
            "disagg_kv_blocks_total": {"decode": [640.0] * 3, "prefill": [256.0] * 3},
            "disagg_queue_depth": {"decode": [0.0, 3.0, 1.0], "prefill": [0.0, 0.0, 0.0]},
            "disagg_requests_in_flight": {"decode": [1.0, 9.0, 2.0], "prefill": [0.0, 1.0, 0.0]},
            "disagg_kv_handoff_bytes_total": {"decode": [1e6, 2e6, 2.9e6]},
            "disagg_kv_handoff_seconds_total": {"decode": [0.01, 0.02, 0.0338]},
            "disagg_kv_handoff_count_total": {"decode": [10.0, 40.0, 67.0]},
        },
    )
    assert series.summary_lines() == [
        "decode: KV blocks in use max 120/640, queue depth max 3, in flight max 9; KV handoff 57 transfers, 1.9 MB, mean 0.42 ms",
        "prefill: KV blocks in use max 4/256, queue depth max 0, in flight max 1",
    ]


def test_report_files(tmp_path):
    samples = _sweep({1.0: 1.0, 2.0: 0.9}, "ensemble") + _sweep({1.0: 1.0, 2.0: 0.5}, "aggregated")
    samples.append(sample(0.05, [0.01], model="aggregated", rate=2.0, chars=[0, 0], index=10, scheduled=1.0))  # no text
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(s.to_json() + "\n" for s in samples))
    assert read_samples([path]) == samples  # JSONL round trip
    metrics = {("disaggregated", 1.0, 4): MetricsSeries((100.0, 100.5), {"disagg_queue_depth": {"decode": [0.0, 2.0]}})}
    report = write_report(tmp_path / "out", read_samples([path]), Slo(100, 50), metrics)

    names = sorted(p.name for p in report.files)
    assert names == ["itl_over_time.png", "latency_cdf.png", "metrics_disaggregated.png", "report.csv", "report.json",
                     "slo_attainment_vs_rate.png"]
    for png in (p for p in report.files if p.suffix == ".png"):
        assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000

    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["goodput_distserve"] == {"aggregated": 1.0, "disaggregated": 2.0}
    assert data["slo"] == {"ttft_ms": 100, "tpot_ms": 50}
    assert "gap between consecutive streamed responses that carry tokens" in data["definitions"]["ITL"]
    assert [(r["deployment"], r["rate"]) for r in data["runs"]] == [
        ("aggregated", 1.0), ("aggregated", 2.0), ("disaggregated", 1.0), ("disaggregated", 2.0)]
    assert data["runs"][2]["metrics"]["summary"] == {"decode": {"max_disagg_queue_depth": 2.0}}

    rows = list(csv.DictReader(open(tmp_path / "out" / "report.csv")))
    assert [(r["deployment"], r["rate"], r["slo_attainment"]) for r in rows] == [
        ("aggregated", "1.0", "1.0"), ("aggregated", "2.0", str(5 / 11)), ("disaggregated", "1.0", "1.0"),
        ("disaggregated", "2.0", "0.9")]
    assert rows[1]["no_text"] == "1"
    assert float(rows[0]["ttft_p50_ms"]) == pytest.approx(50.0)
