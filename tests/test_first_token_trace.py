"""Reading Triton's request traces into where a first token's time went (disagg.bench.first_token_trace); the
bench's traced run on a real server is in tests/test_front_bench.py."""
from __future__ import annotations

import json

import pytest

from disagg.bench.first_token_trace import SEGMENTS, read, table, timelines

MS = 1_000_000  # ns


def _records(trace_id: int, model: str, request_id: str, **stamps) -> list[dict]:
    """A trace as Triton 2.51 writes one: its identity, then its timestamps in several records."""
    return [{"id": trace_id, "model_name": model, "model_version": 1, "request_id": request_id},
            *({"id": trace_id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in stamps.items())]


def _front(trace_id: int, model: str, request_id: str, t: int) -> list[dict]:
    return _records(trace_id, model, request_id, GRPC_WAITREAD_END=t, COMPUTE_START=t + MS // 10,
                    COMPUTE_INPUT_END=t + MS // 5, INFER_RESPONSE_COMPLETE=t + 25 * MS, GRPC_SEND_START=t + 25 * MS + 1,
                    GRPC_SEND_END=t + 25 * MS + MS // 4)


def _hop(trace_id: int, request_id: str, t: int) -> list[dict]:
    return _records(trace_id, "prefill", request_id, HTTP_RECV_START=t, HTTP_RECV_END=t + 1, COMPUTE_START=t + MS // 2,
                    INFER_RESPONSE_COMPLETE=t + 20 * MS + MS // 2, HTTP_SEND_START=0, HTTP_SEND_END=0)


@pytest.fixture
def trace_file(tmp_path):
    t = 10_000 * MS
    records = [
        *_records(1, "prefill", "7", GRPC_WAITREAD_END=t, COMPUTE_START=t + MS // 5, INFER_RESPONSE_COMPLETE=t + 21 * MS,
                  GRPC_SEND_END=t + 21 * MS + MS // 5),  # the direct path: the client's request 7 to prefill
        *_front(2, "tensorrt_llm_bls", "8", t + 100 * MS),
        *_hop(3, "a1b2", t + 101 * MS),  # its hop, 0.9 ms after the stub had it
        *_hop(4, "a1b3", t + 200 * MS),  # another front's request's hop, long after
        *_front(5, "tensorrt_llm_bls", "6", t + 300 * MS),  # a warm-up: not measured
        *_hop(6, "a1b4", t + 301 * MS),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(records))
    return path


def test_each_measured_request_s_first_token_is_split_at_triton_s_own_stamps(trace_file):
    traces = read(trace_file)
    assert {(t.model, t.request_id) for t in traces} == {("prefill", "7"), ("tensorrt_llm_bls", "8"), ("prefill", "a1b2"),
                                                         ("prefill", "a1b3"), ("tensorrt_llm_bls", "6"), ("prefill", "a1b4")}
    assert "HTTP_SEND_START" not in next(t for t in traces if t.request_id == "a1b2").stamps  # a stamp never taken (0)
    found = timelines(traces, {"tensorrt_llm_bls": "bls", "prefill": "direct"}, measured={"7", "8"})
    assert found["direct"] == [pytest.approx({"server in": 0.2, "engine": 20.8, "server out": 0.2})]
    assert found["bls"] == [pytest.approx({"server in": 0.1, "into the stub": 0.1, "stub, to its hop": 0.8, "hop in": 0.5,
                                           "engine": 20.0, "answer back": 3.5, "server out": 0.25})]
    assert list(found["bls"][0]) == list(SEGMENTS)


def test_a_front_request_without_its_hop_is_left_out(trace_file):
    traces = [t for t in read(trace_file) if t.request_id != "a1b2"]  # the next hop came after its first token
    assert timelines(traces, {"tensorrt_llm_bls": "bls", "prefill": "direct"}, measured={"7", "8"}).keys() == {"direct"}


def test_the_table_gives_each_segment_and_the_server_s_share_against_the_direct_path(trace_file):
    found = timelines(read(trace_file), {"tensorrt_llm_bls": "bls", "prefill": "direct"}, measured={"7", "8"})
    lines = table(found, "direct")
    assert lines[0].startswith("  where the first token's time goes inside the server")
    assert lines[1].split() == ["path", "requests", "server", "in", "into", "the", "stub", "stub,", "to", "its", "hop", "hop", "in",
                                "engine", "answer", "back", "server", "out", "in", "the", "server"]
    assert lines[2].split() == ["direct", "1", "0.200", "-", "-", "-", "20.800", "-", "0.200", "21.200"]
    assert lines[3].split() == ["bls", "1", "0.100", "0.100", "0.800", "0.500", "20.000", "3.500", "0.250", "25.250", "(+4.050",
                                "over", "direct)"]
    assert table({}, "direct") == []
