"""The workload model, and loadtest/locustfile.py run headless against a real tritonserver (cpu-tiny)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from disagg.triton.preprocessing import Limits, Preprocessor
from loadtest.samples import read_samples, samples_path
from loadtest.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
DISAGGREGATED = ("preprocessing", "postprocessing", "prefill", "decode", "disagg_orchestrator", "ensemble")


def test_workload_requests_are_seeded_and_sized_in_tokens(tiny_checkpoint):
    tokenizer = tiny_checkpoint / "tokenizer.json"
    w = load_workload("mixed")
    requests = w.requests(tokenizer)
    assert requests == w.requests(tokenizer)  # same seed, same traffic
    assert [r.prompt for r in requests] != [r.prompt for r in replace(w, seed=1).requests(tokenizer)]
    assert len(requests) == w.max_requests
    pre = Preprocessor.load(tiny_checkpoint, Limits(max_input_len=256, max_output_len=319, max_seq_len=320))
    for r in requests:
        assert r.prompt_tokens == len(pre.prepare(r.prompt.encode(), 8).input_ids)  # as the server counts them
        assert r.prompt_tokens <= w.max_prompt_tokens
        assert 32 <= r.max_tokens <= 64
    body = [r.prompt_tokens for r in requests if not r.shared_prefix]
    # each prompt is the longest word sequence within its drawn length: short by less than a word (<= 6 tokens)
    short, long = [n for n in body if n <= 32], [n for n in body if 144 <= n <= 200]
    assert len(short) + len(long) == len(body)
    assert 0.6 < len(short) / len(body) < 0.8
    shared = [r for r in requests if r.shared_prefix]
    assert 0.15 < len(shared) / len(requests) < 0.45
    assert len(os.path.commonprefix([r.prompt for r in shared])) >= 40  # one common system prompt


def test_open_loop_arrivals_are_poisson_at_the_rate():
    w = replace(load_workload("mixed").with_rate(5.0), max_requests=4000)
    times = np.array(w.arrivals())
    assert times[0] == 0.0 and np.all(np.diff(times) > 0)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(0.2, rel=0.05) and gaps.std() == pytest.approx(0.2, rel=0.08)
    assert w.arrivals() == w.arrivals()


def test_an_open_loop_has_a_user_for_every_request_planned_within_its_run():
    w = replace(load_workload("prefill-heavy").with_rate(4.2), max_requests=252, duration_s=60.0)
    planned = sum(t < 60.0 for t in w.arrivals())
    assert w.open_loop_users() == planned and 200 < planned <= 252  # not the workload's 32
    assert replace(w, duration_s=5.0).open_loop_users() == 32  # a short run needs no more than its own users
    assert w.with_rate(None).open_loop_users() == 32  # a closed loop keeps its users


def test_bad_workload_is_rejected(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((ROOT / "loadtest/workloads/quick.yaml").read_text().replace("min: 8, max: 16", "min: 16, max: 8"))
    with pytest.raises(ValueError, match="prompt_tokens: each bin needs weight > 0 and 1 <= min <= max"):
        load_workload(path)


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    s = start_triton(cpu_tiny_project / "model_repository", "--model-control-mode=explicit",
                     *(f"--load-model={m}" for m in DISAGGREGATED))
    yield s
    s.stop()


def test_samples_path_never_defaults_to_the_working_directory(tmp_path):
    assert samples_path("given.jsonl", "results/run") == Path("given.jsonl")
    assert samples_path(None, "results/run") == Path("results/run.samples.jsonl")  # beside --json-file/--csv
    default, another = samples_path(None), samples_path(None)
    try:
        assert default.name == "samples.jsonl" and default.parent.is_dir() and not default.exists()
        assert default.parent != Path.cwd() and default.parent != another.parent  # a new directory each run
    finally:
        default.parent.rmdir()
        another.parent.rmdir()


def run_locust(server, project: Path, out: Path | None, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs the locustfile headless; `out`: where samples.jsonl and locust.json go (None: neither option)."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest/locustfile.py"), "--headless", "--only-summary",
           "--host", f"http://{server.http_url}", "--run-time", "30s", "--loglevel", "WARNING",
           "--model", "ensemble", "--workload", "quick", "--tokenizer", str(project / "build/checkpoints/tiny-llama/tokenizer.json"),
           *(["--samples-out", str(out / "samples.jsonl"), "--json-file", str(out / "locust")] if out else []), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, cwd=cwd)



@pytest.mark.e2e
def test_closed_loop_run_records_every_request(server, cpu_tiny_project, tmp_path):
    proc = run_locust(server, cpu_tiny_project, tmp_path, "-u", "2", "-r", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    entries = json.loads((tmp_path / "locust.json").read_text())
    streams = [e for e in entries if e["method"] == "POST"]
    assert [e["name"] for e in streams] == ["/v2/models/ensemble/generate_stream"]
    samples = read_samples([tmp_path / "samples.jsonl"])
    assert streams[0]["num_requests"] == len(samples) == 8  # quick: max_requests 8, stopped by count
    assert streams[0]["num_failures"] == 0 and all(s.error is None for s in samples)
    metric_rows = {e["name"]: e["num_requests"] for e in entries if e["method"] == "METRIC"}
    assert metric_rows["time_to_first_token"] == sum(s.ttft is not None for s in samples)
    assert sorted(s.index for s in samples) == list(range(8))
    for s in samples:
        assert s.model == "ensemble" and s.rate is None and s.users == 2
        assert s.n_out >= 1 and s.chunk_count >= s.n_out
        # the server's own count of every response: one token each, then the final response with none
        assert s.chunk_tokens == (1,) * s.n_out + (0,), s.chunk_tokens
        assert 0 < s.ttft <= s.e2e
        assert len(s.itl) == s.n_out - 1
        assert s.t_send < s.t_chunks[0] and s.t_chunks == tuple(sorted(s.t_chunks)) and s.t_chunks[-1] <= s.t_end


@pytest.mark.e2e
def test_open_loop_run_follows_the_poisson_schedule(server, cpu_tiny_project, tmp_path):
    proc = run_locust(server, cpu_tiny_project, tmp_path, "-u", "4", "-r", "4", "--request-rate", "4",
                      "--max-requests", "6")
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = sorted(read_samples([tmp_path / "samples.jsonl"]), key=lambda s: s.index)
    planned = replace(load_workload("quick").with_rate(4.0), max_requests=6).arrivals()
    assert [s.scheduled for s in samples] == pytest.approx(planned)
    start = samples[0].t_send
    for s in samples:
        assert s.rate == 4.0 and s.error is None
        assert s.t_send - start == pytest.approx(s.scheduled, abs=0.1)  # sent on time, not back to back


@pytest.mark.e2e
def test_samples_default_to_a_printed_temp_file_not_the_working_directory(server, cpu_tiny_project, tmp_path):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    proc = run_locust(server, cpu_tiny_project, None, "-u", "2", "-r", "2", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(cwd.iterdir()) == []  # nothing left in the working directory
    printed = [line.split("locustfile: samples -> ", 1)[1] for line in proc.stderr.splitlines() if "locustfile: samples -> " in line]
    assert len(printed) == 1
    path = Path(printed[0])
    assert path.name == "samples.jsonl" and path.parent.name.startswith("disagg-locust-")
    try:
        assert len(read_samples([path])) == 8
    finally:
        path.unlink()
        path.parent.rmdir()
