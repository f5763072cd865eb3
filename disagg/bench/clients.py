"""NVIDIA's own benchmark clients against both ensembles, side by side in one run.

    python -m disagg.bench clients --genai-perf /opt/gp/bin/genai-perf --aiperf /opt/aiperf/bin/aiperf

Builds cpu-tiny, starts a tritonserver and the OpenAI-compatible API on free loopback ports, then for each
concurrency runs, alternating `ensemble` (disaggregated) and `aggregated`:
- genai-perf (`--backend tensorrtllm`, gRPC streaming through perf_analyzer, `min_length` for fixed
  lengths): the path a Triton + TensorRT-LLM user measures first;
- AIPerf (`--endpoint-type chat`, streaming over the OpenAI API, `ignore_eos` for fixed lengths, token
  counts from the API's `usage`).
Both tools are installed apart from the project (README, "Measure"); pass the paths of their commands.
Reports each tool's TTFT p50/p99, inter-token latency p50, request latency p50 and output tokens/s, the
disaggregated/aggregated ratio of each, and, from each tool's per-request records, the share of answers
that arrived all at once (every token within 2 ms of the first): streaming that is not streaming.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

INPUT_TOKENS, OUTPUT_TOKENS = 64, 32
BURST_S = 0.002
MODELS = ("ensemble", "aggregated")


@dataclass(frozen=True)
class Summary:
    ttft_p50: float  # ms
    ttft_p99: float
    itl_p50: float
    latency_p50: float
    tokens_per_s: float
    all_at_once: float | None  # share of answers whose tokens all came within BURST_S (None: not measured)
    requests: int

    def cells(self) -> list[float | None]:
        return [self.ttft_p50, self.ttft_p99, self.itl_p50, self.latency_p50, self.tokens_per_s]


def tool_env(command: Path) -> dict[str, str]:
    """The tool's own venv first on PATH (genai-perf runs the perf_analyzer beside it), the CUDA runtime
    library perf_analyzer links on LD_LIBRARY_PATH, and the hub offline (the tokenizer is a local dir)."""
    venv = command.resolve().parent.parent
    libs = [str(p) for p in venv.glob("lib/python3*/site-packages/nvidia/cuda_runtime/lib")]
    env = dict(os.environ, HF_HUB_OFFLINE="1", PATH=os.pathsep.join([str(command.parent), os.environ.get("PATH", "")]))
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + [p for p in [os.environ.get("LD_LIBRARY_PATH")] if p])
    return env


def _run(cmd: list[str], env: dict, cwd: Path, timeout_s: float) -> None:
    done = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")


def all_at_once(profile_export: Path) -> float:
    """Share of requests whose token-carrying responses all arrived within BURST_S of each other."""
    requests = json.loads(profile_export.read_text())["experiments"][0]["requests"]
    bursts = 0
    for r in requests:
        stamps = r["response_timestamps"][:OUTPUT_TOKENS]
        bursts += len(stamps) > 1 and (stamps[-1] - stamps[0]) / 1e9 < BURST_S
    return bursts / len(requests)


def _export(out: Path, name: str) -> Path:
    """A file the tool wrote somewhere under its artifact directory (each adds a run-named folder)."""
    found = sorted(out.rglob(name))
    if not found:
        raise RuntimeError(f"{out}: the tool wrote no {name}")
    return found[0]


def _stat(metrics: dict, name: str, key: str) -> float:
    return float(metrics[name][key])


def genai_perf(command: Path, grpc_url: str, model: str, concurrency: int, requests: int, tokenizer: Path, work: Path) -> Summary:
    out = work / f"genai-perf-{model}-c{concurrency}"
    _run([str(command), "profile", "-m", model, "--backend", "tensorrtllm", "--url", grpc_url, "--streaming",
          "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
          "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-mean-deterministic",
          "--tokenizer", str(tokenizer), "--concurrency", str(concurrency), "--request-count", str(requests),
          "--warmup-request-count", "4", "--artifact-dir", str(out)], tool_env(command), work, 600)
    m = json.loads(_export(out, "profile_export_genai_perf.json").read_text())
    return Summary(_stat(m, "time_to_first_token", "p50"), _stat(m, "time_to_first_token", "p99"),
                   _stat(m, "inter_token_latency", "p50"), _stat(m, "request_latency", "p50"),
                   _stat(m, "output_token_throughput", "avg"), all_at_once(_export(out, "profile_export.json")),
                   int(_stat(m, "request_count", "avg")))


def aiperf_all_at_once(records: Path) -> float:
    """Share of requests (AIPerf's per-request records) whose last token came within BURST_S of the first."""
    spans = []
    for line in records.read_text().splitlines():
        m = json.loads(line)["metrics"]
        spans.append((m["request_latency"]["value"] - m["time_to_first_token"]["value"]) / 1e3)
    return sum(s < BURST_S for s in spans) / len(spans)


def aiperf(command: Path, base_url: str, model: str, concurrency: int, requests: int, tokenizer: Path, work: Path) -> Summary:
    """AIPerf over the OpenAI API's chat endpoint; it counts tokens from our `usage`. HF_HUB_OFFLINE stays
    unset: AIPerf 0.13 then takes the tokenizer path for a hub repo id and stops (it loads the local
    directory without touching the hub anyway)."""
    out = work / f"aiperf-{model}-c{concurrency}"
    env = {k: v for k, v in tool_env(command).items() if k != "HF_HUB_OFFLINE"}
    _run([str(command), "profile", "-m", model, "--endpoint-type", "chat", "--url", base_url, "--streaming",
          "--tokenizer", str(tokenizer), "--apply-chat-template", "--use-server-token-count",
          "--synthetic-input-tokens-mean", str(INPUT_TOKENS), "--synthetic-input-tokens-stddev", "0",
          "--output-tokens-mean", str(OUTPUT_TOKENS), "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
          "--concurrency", str(concurrency), "--request-count", str(requests), "--warmup-request-count", "4",
          "--random-seed", "0", "--ui", "none", "--no-server-metrics", "--no-gpu-telemetry", "--artifact-dir", str(out)],
         env, work, 600)
    m = json.loads(_export(out, "profile_export_aiperf.json").read_text())
    return Summary(_stat(m, "time_to_first_token", "p50"), _stat(m, "time_to_first_token", "p99"),
                   _stat(m, "inter_token_latency", "p50"), _stat(m, "request_latency", "p50"),
                   _stat(m, "output_token_throughput", "avg"), aiperf_all_at_once(_export(out, "profile_export.jsonl")),
                   int(_stat(m, "request_count", "avg")))


def table(rows: dict[tuple[str, int], dict[str, Summary]]) -> list[str]:
    heads = ["TTFT p50", "TTFT p99", "ITL p50", "E2E p50", "tok/s"]
    lines = [f"  {'tool':<11}{'c':>3} {'model':<11}" + "".join(f"{h:>10}" for h in heads) + f"{'at once':>9}{'n':>5}"]
    for (tool, c), by_model in rows.items():
        for model in MODELS:
            s = by_model[model]
            once = "-" if s.all_at_once is None else f"{s.all_at_once:.0%}"
            lines.append(f"  {tool:<11}{c:>3} {model:<11}" + "".join(f"{v:>10.2f}" for v in s.cells()) + f"{once:>9}{s.requests:>5}")
        ratio = [d / a if a else float("nan") for d, a in zip(by_model["ensemble"].cells(), by_model["aggregated"].cells())]
        lines.append(f"  {tool:<11}{c:>3} {'disagg/agg':<11}" + "".join(f"{r:>9.2f}x" for r in ratio))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench clients", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--genai-perf", type=Path, help="the genai-perf command (0.0.16, with perf_analyzer beside it)")
    p.add_argument("--aiperf", type=Path, help="the aiperf command")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=60, help="measured requests per run (default 60)")
    args = p.parse_args(argv)
    if not (args.genai_perf or args.aiperf):
        p.error("name at least one tool: --genai-perf and/or --aiperf")

    from disagg.cli import build
    from disagg.serve.openai_front import OpenAIFront
    from disagg.serve.server import TritonServer
    from disagg.spec import load_spec

    spec = load_spec("configs/cpu-tiny.yaml")
    build(spec, log=lambda _msg: None)
    tokenizer = spec.model.path.resolve()
    rows: dict[tuple[str, int], dict[str, Summary]] = {}
    with tempfile.TemporaryDirectory(prefix="disagg-clients-") as tmp, \
            TritonServer(spec.model_repository, log_path=Path("build/bench-clients.log")) as server, \
            OpenAIFront(spec.model_repository, server.grpc_url, log_path=Path("build/bench-clients-openai.log")) as front:
        work = Path(tmp)
        for c in args.concurrency:
            for tool, command, run, url in (("genai-perf", args.genai_perf, genai_perf, server.grpc_url),
                                             ("aiperf", args.aiperf, aiperf, front.base_url.removesuffix("/v1"))):
                if command is None:
                    continue
                rows[(tool, c)] = {}
                for model in MODELS:
                    print(f"{tool} {model} concurrency {c} ...", file=sys.stderr, flush=True)
                    rows[(tool, c)][model] = run(command, url, model, c, args.requests, tokenizer, work)
    print(f"NVIDIA clients, streaming, {INPUT_TOKENS} tokens in, {OUTPUT_TOKENS} out (ms; tok/s = output tokens/s; "
          f"at once = answers whose tokens all arrived within {BURST_S * 1e3:.0f} ms):")
    print("\n".join(table(rows)))
    return 0
