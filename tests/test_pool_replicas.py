"""Pool replicas on loopback ports, discovered at run time: tritonservers join and leave a registry while
requests run, and none of those requests fails; a replica that leaves finishes what it holds first.

Each replica is a `disagg-serve --announce` of the cpu-tiny repository with a load board of its own (a
deployment of its own on this machine, as a pod is on its node) and the deployment's shared internal key;
the front serves the ensemble with its orchestrator's engine models named by the registries."""
from __future__ import annotations

import secrets
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.engine.no_compute import stand_in_env
from disagg.engine.sampling import NO_END_ID
from disagg.serve.leftovers import names as shm_names
from disagg.serve.metrics import scrape
from disagg.serve.process import Served
from tools.stream_client import StreamError, stream

pytestmark = pytest.mark.e2e
PROMPTS = [f"pool request {i}: the quick brown fox" for i in range(4)]
TOKENS = 24
LONG_TOKENS, LONG_REQUESTS = 290, 6
# The decode replicas stand in for GPUs (disagg.engine.no_compute): each step takes this long off the CPU, so a
# long request decodes for over a second on any machine, longer than a drain's first wait. Computing, a fast
# machine's cores finished the long requests before the stop could find them held.
DECODE_STEP_MS = 5.0


@pytest.fixture
def pools(cpu_tiny_project, tmp_path):
    """start(name, models, registry) -> a ready replica; the front is started by `front()`. All stopped after."""
    repository = cpu_tiny_project / "model_repository"
    key = secrets.token_hex(16)
    registries = {"prefill": tmp_path / "registry-prefill", "decode": tmp_path / "registry-decode"}
    started: list[Served] = []

    def env(name: str) -> dict[str, str]:
        board = tmp_path / f"board-{name}"
        board.mkdir()
        return {"DISAGG_INTERNAL_KEY": key, "DISAGG_LOAD_BOARD": str(board)}

    def replica(name: str, role: str) -> Served:
        stand_in = stand_in_env(DECODE_STEP_MS) if role == "decode" else {}
        served = Served(name, repository, {**env(name), **stand_in}, f"--load-model={role}", f"--announce={registries[role]}")
        started.append(served)
        return served

    def front() -> Served:
        urls = ",".join(f"{role}=registry:{path}" for role, path in registries.items())
        models = [f"--load-model={m}" for m in ("preprocessing", "disagg_orchestrator", "postprocessing", "ensemble")]
        served = Served("front", repository, {**env("front"), "DISAGG_ENGINE_URLS": urls}, *models)
        started.append(served)
        return served

    yield replica, front, registries
    for served in reversed(started):
        served.stop()


def _ask(front: Served, i: int) -> str:
    return stream(front.url, "ensemble", PROMPTS[i % len(PROMPTS)], TOKENS, end_id=NO_END_ID, timeout_s=60).text


def test_replicas_join_and_leave_while_requests_run_and_none_fails(pools):
    replica, front_of, registries = pools
    before_shm = shm_names()
    prefill = replica("prefill-1", "prefill")
    decode_1, decode_2 = replica("decode-1", "decode"), replica("decode-2", "decode")
    front = front_of()
    for served in (prefill, decode_1, decode_2, front):
        served.ready()
    expected = [_ask(front, i) for i in range(len(PROMPTS))]  # greedy: every later answer must be the same
    expected_long = stream(front.url, "ensemble", PROMPTS[0], LONG_TOKENS, end_id=NO_END_ID, timeout_s=60).text
    # Idle, each replica's engine reports as the tensorrtllm backend does (custom_metrics_reporter.cc); the
    # gauges follow the engine every 0.1 s, so the last answer's blocks may still show for a moment.
    deadline = time.monotonic() + 5
    while True:
        families = {(s.name, s.labels.get("request_type") or s.labels.get("kv_cache_block_type")): (s.labels, s.value)
                    for f in text_string_to_metric_families(scrape(f"http://127.0.0.1:{decode_2.metrics}/metrics", 2.0))
                    for s in f.samples if s.name.startswith("nv_trt_llm_")}
        if families[("nv_trt_llm_kv_cache_block_metrics", "used")][1] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {key: value for key, (labels, value) in families.items()} == {
        ("nv_trt_llm_request_metrics", "active"): 0, ("nv_trt_llm_request_metrics", "max"): 32,
        ("nv_trt_llm_request_metrics", "scheduled"): 0, ("nv_trt_llm_request_metrics", "context"): 0,
        ("nv_trt_llm_kv_cache_block_metrics", "max"): 640, ("nv_trt_llm_kv_cache_block_metrics", "free"): 640,
        ("nv_trt_llm_kv_cache_block_metrics", "used"): 0, ("nv_trt_llm_kv_cache_block_metrics", "tokens_per"): 16,
    }
    assert all(labels["model"] == "decode" and labels["version"] == "1" for labels, _ in families.values())
    assert all(len(text) > 0 for text in expected)

    answers: dict[int, str] = {}
    errors: list[str] = []
    done = threading.Event()

    def worker(first: int) -> None:
        i = first
        while not done.is_set() and i < 400:  # bounded: stops when the churn below is over
            try:
                answers[i] = _ask(front, i)
            except (StreamError, TimeoutError) as exc:
                errors.append(f"request {i}: {exc}")
            i += 4

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(worker, w) for w in range(4)]
        decode_3 = replica("decode-3", "decode").ready()  # joins while requests run
        deadline = time.monotonic() + 30
        while decode_3.inferences("decode") < 3:
            assert time.monotonic() < deadline, "the replica that joined was never sent a request"
            time.sleep(0.05)
        deadline = time.monotonic() + 30
        while not ((load := decode_1.load("decode")) and load.active > 0):  # leaves while it holds requests
            assert time.monotonic() < deadline, "decode-1 never held a request"
            time.sleep(0.01)
        held = load.active
        left_at = time.monotonic()
        decode_1.proc.send_signal(signal.SIGTERM)
        assert decode_1.proc.wait(60) == 0, "".join(decode_1.lines[-30:])
        drained_s = time.monotonic() - left_at
        time.sleep(1.0)  # the remaining replicas serve on
        done.set()
        for future in futures:
            future.result(120)

    logs = {s.name: "".join(line for line in s.lines[-40:] if "Timeout " not in line) for s in (front, prefill, decode_1, decode_2, decode_3)}
    assert errors == [], (errors, logs)
    assert len(answers) >= 12
    assert all(text == expected[i % len(PROMPTS)] for i, text in answers.items())
    assert any("left the registry" in line and "draining" in line for line in decode_1.lines), decode_1.lines[-20:]
    (drained,) = [line for line in decode_1.lines if line.startswith("disagg-serve: drained in")]
    assert "still held" not in drained, drained
    print(f"decode-1 held {held} requests when told to stop; {drained.strip()}; exited after {drained_s:.1f} s; "
          f"{len(answers)} requests, {decode_3.inferences('decode')} of them on decode-3 (joined mid-run)")
    assert held > 0 and drained_s >= 1.0  # it left the registry, then finished the requests it held
    assert sorted(p.name for p in registries["decode"].iterdir()) == sorted(
        [f"http_127.0.0.1_{decode_2.http}.json", f"http_127.0.0.1_{decode_3.http}.json"])

    # A replica told to stop finishes the requests it holds: long answers, started on the two decode
    # replicas left, arrive whole although both are stopped while they run.
    long_answers: list[str] = []
    responses = [0] * LONG_REQUESTS  # per long request: its first comes from prefill, every later one from decode

    def ask_long(i: int) -> None:
        long_answers.append(stream(front.url, "ensemble", PROMPTS[0], LONG_TOKENS, end_id=NO_END_ID, timeout_s=60,
                                   on_text=lambda text: responses.__setitem__(i, responses[i] + 1)).text)

    asking = [threading.Thread(target=ask_long, args=(i,)) for i in range(LONG_REQUESTS)]
    for thread in asking:
        thread.start()
    deadline = time.monotonic() + 30
    while min(responses) < 2:  # every long request is decoding on one of the two (none has a decode hop to find)
        assert time.monotonic() < deadline, f"the long requests did not all reach a decode replica: {responses}"
        time.sleep(0.01)
    time.sleep(0.3)  # the engines publish their load every 0.1 s: the drain's count at the stop then includes them
    for served in (decode_2, decode_3):
        served.proc.send_signal(signal.SIGTERM)
    for served in (decode_2, decode_3):
        assert served.proc.wait(60) == 0, "".join(served.lines[-20:])
    for thread in asking:
        thread.join(60)
    assert long_answers == [expected_long] * LONG_REQUESTS
    drains = [line.strip() for served in (decode_2, decode_3) for line in served.lines if line.startswith("disagg-serve: drained in")]
    # Told to stop while they held the long requests, and they finished them all before stopping.
    assert len(drains) == 2 and sum(int(line.split(", ")[1].split()[0]) for line in drains) > 0, drains
    assert not any("still held" in line for line in drains), drains
    print(f"long requests drained: {drains}")

    # With every decode replica gone, a request is refused at once, retryable, naming the pool.
    with pytest.raises(StreamError, match=rf"decode: no replica is serving \(registry:{registries['decode']}\): retry shortly"):
        _ask(front, 0)
    for served in (front, prefill):
        assert served.stop() == 0
    leaked = {n for n in shm_names() - before_shm if n.startswith("disagg")}
    assert leaked == set()
