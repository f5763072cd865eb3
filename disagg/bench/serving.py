"""Serving overheads, measured side by side in one run.

1. Orchestration overhead on a real tritonserver (cpu-tiny): per-request latency through `ensemble`
   (preprocessing -> orchestrator -> prefill + decode -> postprocessing) against calling the
   engine models directly with token ids (prefill context_only, then decode generation_only), and
   `aggregated` against `aggregated_engine`. Streaming overhead per token = difference of the mean
   gap between streamed responses.
2. KV handoff bandwidth for prompts of the bench-100mb model, against a plain numpy copy of the same
   bytes. Each way ends with the KV in decode's blocks: the direct handoff decode uses when it has room
   (claim, copy prefill's shared-memory blocks straight into decode's reserved blocks, ack), the
   buffered one it uses when full (claim, gather into a new contiguous buffer, ack; later, at
   admission, scatter into decode's blocks), and TCP between nodes (claim, fetch the wire format, ack,
   scatter).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import queue
import threading
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from disagg.bench.engine import build_engine
from disagg.engine.engine import LLMEngine, Request
from disagg.engine.kv_cache import KVStorage, blocks_for
from disagg.engine.loop import EngineLoop
from disagg.transfer.agent import TransferAgent
from disagg.transfer.puller import KVPuller
from disagg.transfer.shm import SharedPool
from disagg.triton.credential import PARAMETER


def _tensor(name: str, array: np.ndarray, dtype: str) -> grpcclient.InferInput:
    t = grpcclient.InferInput(name, list(array.shape), dtype)
    t.set_data_from_numpy(array)
    return t


class Streamer:
    """One gRPC stream reused for sequential requests; returns response arrival times. `credential`: the
    request parameters that let it call engine models directly (disagg.triton.credential)."""

    def __init__(self, url: str, internal_key: str = ""):
        self.credential = {PARAMETER: internal_key}
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.responses.put((time.perf_counter(), result, error)))

    def call(self, model: str, inputs, parameters=None) -> tuple[float, list[float], list]:
        start = time.perf_counter()
        self.client.async_stream_infer(model, inputs, parameters=parameters, enable_empty_final_response=True)
        stamps, results = [], []
        while True:
            at, result, error = self.responses.get(timeout=60)
            if error is not None:
                raise RuntimeError(f"{model}: {error}")
            if result.get_response().outputs:
                stamps.append(at - start)
                results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                return time.perf_counter() - start, stamps, results

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


def _text_inputs(prompt: str, max_tokens: int) -> list:
    return [
        _tensor("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
        _tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _tensor("stream", np.array([[True]]), "BOOL"),
    ]


def _engine_inputs(ids: list[int], max_tokens: int, params: np.ndarray | None = None) -> list:
    inputs = [
        _tensor("input_ids", np.array([ids], dtype=np.int32), "INT32"),
        _tensor("input_lengths", np.array([[len(ids)]], dtype=np.int32), "INT32"),
        _tensor("request_output_len", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        _tensor("end_id", np.array([[1]], dtype=np.int32), "INT32"),
        _tensor("streaming", np.array([[True]]), "BOOL"),
    ]
    if params is not None:
        inputs.append(_tensor("context_phase_params", params.reshape(1, -1), "UINT8"))
    return inputs


def orchestration_overhead(requests: int, max_tokens: int) -> list[str]:
    from disagg.cli import build
    from disagg.serve.server import TritonServer
    from disagg.spec import load_spec
    from disagg.text import encode_prompt, load_tokenizer

    spec = load_spec("configs/cpu-tiny.yaml")
    build(spec, log=lambda _msg: None)
    tokenizer = load_tokenizer(spec.model.path)
    prompt = "It was the best of times, it was the worst of times, it was the age of wisdom"
    ids = encode_prompt(tokenizer, prompt)  # as preprocessing tokenizes it
    paths = {
        "ensemble (disaggregated)": lambda s: s.call("ensemble", _text_inputs(prompt, max_tokens)),
        "prefill + decode, direct": lambda s: _direct_disaggregated(s, ids, max_tokens),
        "aggregated (ensemble)": lambda s: s.call("aggregated", _text_inputs(prompt, max_tokens)),
        "aggregated_engine, direct": lambda s: s.call("aggregated_engine", _engine_inputs(ids, max_tokens), s.credential),
    }
    samples: dict[str, list[tuple]] = {name: [] for name in paths}  # (e2e, ttft, mean gap, responses)
    with TritonServer(spec.model_repository, log_path=Path("build/bench-serving.log")) as server:
        streamer = Streamer(server.grpc_url, server.internal_key)
        try:
            for run in paths.values():
                for _ in range(5):
                    run(streamer)  # warm-up: connections, first-call imports
            for _ in range(requests):  # one request per path in turn: drift on a shared machine hits all alike
                for name, run in paths.items():
                    total, stamps, _ = run(streamer)
                    tokens = stamps[:max_tokens]  # the ensembles' final response carries no token
                    samples[name].append((total, stamps[0], float(np.mean(np.diff(tokens))), len(stamps)))
        finally:
            streamer.close()
    stats = {name: tuple(np.median(np.array(rows), axis=0)) for name, rows in samples.items()}
    lines = [f"orchestration overhead ({requests} requests per path, interleaved, {max_tokens} tokens each; medians;",
             "  gap = a request's mean gap between its token responses):",
             f"  {'path':<28}{'E2E ms':>9}{'TTFT ms':>9}{'gap ms':>9}{'responses':>11}"]
    for name, (e2e, ttft, gap, n) in stats.items():
        lines.append(f"  {name:<28}{e2e * 1e3:>9.2f}{ttft * 1e3:>9.2f}{gap * 1e3:>9.3f}{n:>11.0f}")
    for front, direct in (("ensemble (disaggregated)", "prefill + decode, direct"), ("aggregated (ensemble)", "aggregated_engine, direct")):
        (fe, ft, fg, _), (de, dt, dg, _) = stats[front], stats[direct]
        lines.append(f"  {front} vs {direct}: E2E +{(fe - de) * 1e3:.2f} ms ({fe / de:.2f}x), TTFT +{(ft - dt) * 1e3:.2f} ms, per token +{(fg - dg) * 1e3:.3f} ms")
    return lines


def _direct_disaggregated(streamer: Streamer, ids: list[int], max_tokens: int):
    """The client does the orchestrator's job: context_only on prefill, then generation_only on decode."""
    t0 = time.perf_counter()
    _, stamps, results = streamer.call("prefill", _engine_inputs(ids, max_tokens), {"request_type": "context_only", **streamer.credential})
    params = results[-1].as_numpy("context_phase_params")
    _, more, _ = streamer.call("decode", _engine_inputs(ids, max_tokens, params), {"request_type": "generation_only", **streamer.credential})
    offset = stamps[-1]
    return time.perf_counter() - t0, [stamps[0], *(offset + s for s in more)], None


def handoff_bandwidth(root: Path, prompt_lens: list[int], repeats: int) -> list[str]:
    engine_dir = build_engine(root, "bench-100mb", 4, max(prompt_lens), 2)
    lines = [f"KV handoff bandwidth (bench-100mb: 8 layers x 4 KV heads x 64, fp32; MB/s, median of {repeats}),",
             "each until the KV is in decode's blocks:",
             "  direct = claim + copy prefill's shm blocks into decode's reserved blocks + ack (decode has room)",
             "  buffered = claim + gather the shm blocks into a new buffer + ack + scatter (decode full)",
             "  tcp = claim + fetch the wire format + ack + scatter (across nodes)",
             "  memcpy = np.copyto of the same bytes into a reused buffer",
             f"  {'prompt':>7}{'KV MB':>8}{'direct':>9}{'buffered':>10}{'tcp':>8}{'memcpy':>9}{'direct/memcpy':>15}{'direct/buffered':>17}"]
    for tokens in prompt_lens:
        rates = {}
        for mode, transport in (("direct", "shm"), ("buffered", "shm"), ("tcp", "tcp")):
            with _prefill(engine_dir, transport) as (loop, agent):
                puller, decode_pool = KVPuller(), _pool_like(loop.engine, tokens)
                blocks = list(range(decode_pool.shapes[0].num_blocks))
                seconds = []
                for i in range(repeats + 1):
                    params = _context(loop, agent, f"{mode}-{tokens}-{i}", tokens)
                    if mode == "direct":
                        claim = puller.claim(params)
                        claim.kv.copy_into(decode_pool, params.layout, blocks)
                        elapsed, nbytes = puller.ack(claim), claim.kv.nbytes
                    else:  # copy out (shm) or fetch (tcp), ack; then the scatter admission does
                        pulled = puller.pull(params)
                        t = time.perf_counter()
                        pulled.kv.copy_into(decode_pool, params.layout, blocks)
                        elapsed, nbytes = pulled.seconds + time.perf_counter() - t, pulled.nbytes
                    if i:  # the first opens the connection, maps the segment and faults in decode's pool
                        seconds.append(elapsed)
                puller.close()
            rates[mode] = nbytes / float(np.median(seconds))
        src = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(src)
        memcpy = nbytes / _median_seconds(lambda: np.copyto(dst, src), repeats)
        lines.append(
            f"  {tokens:>7}{nbytes / 1e6:>8.2f}{rates['direct'] / 1e6:>9.0f}{rates['buffered'] / 1e6:>10.0f}"
            f"{rates['tcp'] / 1e6:>8.0f}{memcpy / 1e6:>9.0f}{rates['direct'] / memcpy:>15.2f}{rates['direct'] / rates['buffered']:>17.2f}"
        )
    return lines


def _pool_like(prefill: LLMEngine, tokens: int) -> KVStorage:
    """A decode pool sharded like prefill, with just enough blocks for `tokens`."""
    blocks = blocks_for(tokens, prefill.config.build.tokens_per_block)
    return KVStorage([dataclasses.replace(s, num_blocks=blocks) for s in prefill.kv.shapes])


def _median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


@contextlib.contextmanager
def _prefill(engine_dir: Path, transport: str):
    pool = SharedPool()
    loop = EngineLoop(LLMEngine(engine_dir, kv_buffer=pool.allocate if transport == "shm" else None))
    agent = TransferAgent(loop, transport, pool.name)
    try:
        yield loop, agent
    finally:
        agent.close()
        loop.stop()
        pool.unlink()


def _context(loop: EngineLoop, agent: TransferAgent, req_id: str, tokens: int):
    done, first = threading.Event(), []
    prompt = tuple(int(t) for t in np.random.default_rng(tokens).integers(2, 4000, tokens))
    loop.submit(Request(req_id, prompt, 2, "context_only"), lambda o: (first.append(o), done.set()))
    done.wait(60)
    return agent.hold(first[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench serving", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=50, help="sequential requests per path")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--root", type=Path, default=Path("build"))
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    for line in handoff_bandwidth(args.root, [64, 256, 1024], args.repeats):
        print(line)
    print()
    for line in orchestration_overhead(args.requests, args.max_tokens):
        print(line)
    return 0
