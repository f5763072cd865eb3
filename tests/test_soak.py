"""The soak, short: 30 s of streaming load with cancellations and bad inputs, decode and prefill stubs
killed with -9 and decode stopped (SIGSTOP) for 5 s (`python -m loadtest soak --duration 300` is the full
run)."""
from __future__ import annotations

import pytest

from loadtest.soak import Report, run


@pytest.mark.e2e
def test_a_short_soak_hangs_nothing_leaks_nothing_and_heals_every_fault(cpu_tiny_project, tmp_path):
    log = tmp_path / "soak.log"
    report = run(cpu_tiny_project / "model_repository", duration_s=24, clients=4, pause_s=5.0, log=log)
    events = [line for line in log.read_text().splitlines()
              if line.startswith("disagg-serve:") or "Signal" in line or "terminate" in line or "exception" in line]
    assert report.failures() == [], (report, events[-40:])
    assert [f["fault"] for f in report.faults] == ["kill -9 decode", "kill -9 prefill", "pause decode"]
    # A killed stub, or ending a stopped one, can abort the engine's own server (README, Known problems):
    # then that server is started again, which takes longer than a model reload.
    assert all(f["served_again_after_s"] < (10.0 if f["engine_server_restarted"] else 5.0) for f in report.faults), report
    assert report.outcomes.get("completed", 0) > 80 and report.outcomes.get("bad_input_refused", 0) > 10, report.outcomes
    assert report.outcomes.get("hung", 0) == 0 and report.server_restarts == 0
    assert report.engine_restarts["prefill"] >= 1 and report.engine_restarts["decode"] >= 2, report.engine_restarts
    assert any("has been stopped for" in line for line in events), events


def test_a_bad_input_misanswered_fails_the_soak_unless_it_met_an_engine_outage():
    outage = {"sent_at_s": 60.1, "bad_input": "NaN temperature",
              "got": "NaN temperature: expected 'temperature: nan must be in [0, 100]' in the error, got \"in ensemble "
                     "'ensemble', decode: no live engine instance (decode_0_0 (pid 1) died; it is being reloaded): retry shortly\""}
    accepted = {"sent_at_s": 80.0, "bad_input": "top_p above 1", "got": "top_p above 1: accepted (200): {...}"}
    # Triton's own answers to a call made straight to an engine model whose stub was just killed, then reloading
    # (both seen in soaks, 0.1 and 0.4 s after `kill -9 decode`)
    dead_stub = {"sent_at_s": 4.9, "bad_input": "generation_only without params",
                 "got": "expected 'context_phase_params: required for a generation_only request' in the error, "
                        "got \"Stub process 'decode_0_0' is not healthy.\""}
    reloading = {"sent_at_s": 5.2, "bad_input": "forged context_phase_params",
                 "got": "expected 'context_phase_params' in the error, got \"Request for unknown model: 'decode' has no available versions\""}
    assert Report(30.0, misanswered=[outage, dead_stub, reloading]).failures() == []
    [failure] = Report(30.0, misanswered=[outage, accepted]).failures()
    assert failure.startswith("1 bad inputs answered with neither their refusal nor an engine outage") and "top_p above 1" in failure
