"""perf_analyzer, unmodified, against both ensembles of a real tritonserver, with the inputs genai-perf
0.0.16 generates for `--backend tensorrtllm --streaming --output-tokens-mean-deterministic` (text_input,
max_tokens, exclude_input_in_output, stream, min_length): every request is answered, streamed token by
token, with the text the ensemble gives any other client. `tools/install_perf_analyzer.sh` installs it.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from disagg.bench.perf_load import export
from tools.stream_client import stream

pytestmark = pytest.mark.e2e

PROMPT = "It was the best of times, it was the worst of times"
TOKENS = 32
REQUESTS = 12


@pytest.fixture(scope="module")
def server(cpu_tiny_project, start_triton):
    s = start_triton(cpu_tiny_project / "model_repository")
    yield s
    s.stop()


def run(server, model: str, workdir: Path, concurrency: int) -> list[dict]:
    """perf_analyzer's profile export: one entry per request, with its responses' outputs."""
    data = {"data": [{"text_input": [PROMPT], "max_tokens": [TOKENS], "exclude_input_in_output": [True],
                      "stream": [True], "min_length": [TOKENS]}]}
    doc, _ = export(server.grpc_url, model, concurrency, REQUESTS, data, workdir, timeout_s=120)
    [experiment] = doc["experiments"]
    return experiment["requests"]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_perf_analyzer_streams_what_genai_perf_asks_from_both_ensembles(server, tmp_path, concurrency):
    expected = stream(server.grpc_url, "aggregated", PROMPT, TOKENS, exclude_input_in_output=True, min_length=TOKENS).text
    assert expected
    for model in ("ensemble", "aggregated"):
        requests = run(server, model, tmp_path, concurrency)
        assert len(requests) == REQUESTS
        for request in requests:
            outputs = request["response_outputs"]
            assert "".join(o["text_output"] for o in outputs) == expected, model
            assert [o["num_output_tokens"] for o in outputs] == [1] * TOKENS + [0], model  # one token per response, then the final
            assert len(request["response_timestamps"]) == TOKENS + 1
