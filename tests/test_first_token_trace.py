"""Reading Triton's request traces into where a first token's time went (disagg.bench.first_token_trace); the
bench's traced run on a real server is in tests/test_front_bench.py."""
from __future__ import annotations

import json

import pytest

from disagg.bench.first_token_trace import SEGMENTS, read, table, timelines

MS = 1_000_000  # ns
T = 10_000 * MS
# the client's times (seconds) of the requests it measured: 7 to prefill, 8 to the BLS (6, a warm-up, is not one)
MEASURED = {"7": ((T - MS // 10) / 1e9, (T + 21 * MS + MS // 5 + 3 * MS // 10) / 1e9),
            "8": ((T + 100 * MS - MS // 5) / 1e9, (T + 125 * MS + MS // 4 + 3 * MS // 20) / 1e9)}


def _records(trace_id: int, model: str, request_id: str, **stamps) -> list[dict]:
    """A trace as Triton 2.51 writes one: its identity, then its timestamps in several records."""
    return [{"id": trace_id, "model_name": model, "model_version": 1, "request_id": request_id},
            *({"id": trace_id, "timestamps": [{"name": name, "ns": ns}]} for name, ns in stamps.items())]


def _front(trace_id: int, model: str, request_id: str, t: int) -> list[dict]:
    return _records(trace_id, model, request_id, GRPC_WAITREAD_END=t, COMPUTE_START=t + MS // 10,
                    COMPUTE_INPUT_END=t + MS // 5, INFER_RESPONSE_COMPLETE=t + 25 * MS, GRPC_SEND_START=t + 25 * MS + MS // 4,
                    GRPC_SEND_END=t + 25 * MS + MS // 2)  # gRPC reported the write after the client had it


def _hop(trace_id: int, request_id: str, t: int) -> list[dict]:
    return _records(trace_id, "prefill", request_id, HTTP_RECV_START=t, HTTP_RECV_END=t + 1, COMPUTE_START=t + MS // 2,
                    INFER_RESPONSE_COMPLETE=t + 20 * MS + MS // 2, HTTP_SEND_START=0, HTTP_SEND_END=0)


@pytest.fixture
def trace_file(tmp_path):
    t = T
    records = [
        *_records(1, "prefill", "7", GRPC_WAITREAD_END=t, COMPUTE_START=t + MS // 5, INFER_RESPONSE_COMPLETE=t + 21 * MS,
                  GRPC_SEND_START=t + 21 * MS + MS // 5, GRPC_SEND_END=t + 21 * MS + MS // 4),  # the direct path: request 7
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
    found = timelines(traces, {"tensorrt_llm_bls": "bls", "prefill": "direct"}, MEASURED)
    assert found["direct"] == [pytest.approx({"client to server": 0.1, "server in": 0.2, "engine": 20.8, "server out": 0.2,
                                              "server to client": 0.3})]
    assert found["bls"] == [pytest.approx({"client to server": 0.2, "server in": 0.1, "into the stub": 0.1, "stub, to its hop": 0.8,
                                           "hop in": 0.5, "engine": 20.0, "answer back": 3.5, "server out": 0.25,
                                           "server to client": 0.15})]
    # the segments add up to the TTFT the client saw
    for path, request in (("direct", "7"), ("bls", "8")):
        assert sum(found[path][0].values()) == pytest.approx((MEASURED[request][1] - MEASURED[request][0]) * 1e3)
    assert list(found["bls"][0]) == list(SEGMENTS)


def test_a_front_request_without_its_hop_is_left_out(trace_file):
    traces = [t for t in read(trace_file) if t.request_id != "a1b2"]  # the next hop came after its first token
    assert timelines(traces, {"tensorrt_llm_bls": "bls", "prefill": "direct"}, MEASURED).keys() == {"direct"}


def test_the_table_gives_each_segment_and_the_server_s_share_against_the_direct_path(trace_file):
    found = timelines(read(trace_file), {"tensorrt_llm_bls": "bls", "prefill": "direct"}, MEASURED)
    lines = table(found, "direct")
    assert lines[0].startswith("  where the first token's time goes (Triton's request traces of the alternated rounds")
    assert lines[1].split() == ["path", "requests", "client", "to", "server", "server", "in", "into", "the", "stub", "stub,", "to",
                                "its", "hop", "hop", "in", "engine", "answer", "back", "server", "out", "server", "to", "client",
                                "in", "the", "server", "TTFT"]
    assert lines[2].split() == ["direct", "1", "0.100", "0.200", "-", "-", "-", "20.800", "-", "0.200", "0.300", "21.200", "21.600"]
    assert lines[3].split() == ["bls", "1", "0.200", "0.100", "0.100", "0.800", "0.500", "20.000", "3.500", "0.250", "0.150",
                                "25.250", "(+4.050)", "25.600", "(+4.000)"]
    assert table({}, "direct") == []
