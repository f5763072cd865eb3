"""TTFT with prefix reuse (`enable_kv_cache_reuse`) vs without, and cache-aware vs random routing.

Two engines of the same model and limits, one with reuse, run the same requests one at a time (TTFT is
then the prefill the request needs, nothing queued before it), conversation by conversation on one then
the other: (a) prompts whose first 90% is one shared
system prompt and few-shot block, (b) 8-turn conversations, each turn the whole history plus a new user
message, (c) prompts that share nothing, where reuse can only cost (hashing, lookups). Prints TTFT p50
and p95 of each engine, their ratio, the median of the per-request ratios (each request timed on both
engines back to back: the figure least moved by the machine's drift), and the hit rate (prompt blocks
found cached / looked up).

Then, served (cpu-tiny with reuse and two prefill instances, one tritonserver per routing): four system
prompts asked four questions each, interleaved, through `ensemble`; the prefill hit rate with
`prefill_routing: cache_aware` and with `random`.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from disagg.bench.engine import build_engine
from disagg.engine.engine import LLMEngine, Request
from disagg.engine.sampling import NO_END_ID


def _ttft(engine: LLMEngine, req_id: str, prompt: tuple[int, ...], max_new: int) -> tuple[float, list[int]]:
    """Seconds to the first token of a request run alone, and all its tokens."""
    engine.add_request(Request(req_id, prompt, max_new, end_id=NO_END_ID))
    t, first, out = time.perf_counter(), None, []
    while engine.has_work():
        for o in engine.step():
            out += o.tokens
            first = first or time.perf_counter() - t
    return first, out


def workloads(prompt_len: int, count: int, vocab: int, seed: int = 0) -> dict[str, list[list[tuple[int, ...]]]]:
    """name -> conversations, each a list of turns' prompts without the answers (filled in as they run)."""
    rng = np.random.default_rng(seed)

    def toks(n: int) -> tuple[int, ...]:
        return tuple(int(t) for t in rng.integers(2, vocab, n))

    shared = toks(prompt_len * 9 // 10)
    return {
        "(a) 90% shared prefix": [[shared + toks(prompt_len - len(shared))] for _ in range(count)],
        "(b) 8-turn conversations": [[toks(prompt_len // 8)] + [toks(prompt_len // 16) for _ in range(7)] for _ in range(max(1, count // 8))],
        "(c) nothing shared": [[toks(prompt_len)] for _ in range(count)],
    }


def run_workload(engines: dict[bool, LLMEngine], conversations: list[list[tuple[int, ...]]], answer_tokens: int,
                 tag: str) -> dict[bool, tuple[list[float], list[list[int]]]]:
    """{reuse: (TTFT of every turn, answers)}. Each conversation runs on both engines back to back, so a
    drift in the machine's speed hits both alike; a turn's prompt is the history (earlier turns and their
    answers, each engine's own) + its message."""
    out = {reuse: ([], []) for reuse in engines}
    for c, turns in enumerate(conversations):
        for reuse, engine in engines.items():
            ttfts, answers = out[reuse]
            history: tuple[int, ...] = ()
            for t, message in enumerate(turns):
                history += message
                ttft, tokens = _ttft(engine, f"{tag}-{c}-{t}", history, answer_tokens)
                ttfts.append(ttft)
                answers.append(tokens)
                history += tuple(tokens)
    return out


ROUTING_PARAM = 'key: "prefill_routing" value: {{ string_value: "{}" }}'


def routing_hit_rates(repo: Path, routings: tuple[str, ...] = ("cache_aware", "random")) -> dict[str, tuple[float, float]]:
    """Serves `repo` (reuse on, several prefill instances) once per routing; {routing: (blocks reused,
    looked up)} over the prefill instances for the interleaved shared-prompt workload."""
    from disagg.serve.metrics import by_role, scrape
    from disagg.serve.server import TritonServer
    from tools.stream_client import stream

    systems = [f"System prompt {i}: " + " ".join(f"rule {i}.{j} is to be brief and kind" for j in range(4)) + ". " for i in range(4)]
    requests = [system + f"Question {q}?" for q in range(4) for system in systems]
    config = repo / "disagg_orchestrator" / "config.pbtxt"
    rendered = next(r for r in ("cache_aware", "least_loaded", "random") if ROUTING_PARAM.format(r) in config.read_text())
    out = {}
    try:
        for routing in routings:
            config.write_text(config.read_text().replace(ROUTING_PARAM.format(rendered), ROUTING_PARAM.format(routing)))
            rendered = routing
            with TritonServer(repo, log_path=repo.parent / f"server-{routing}.log") as server:  # fresh engines: empty caches
                for prompt in requests:
                    stream(server.grpc_url, "ensemble", prompt, 4)
                time.sleep(0.3)  # the engines refresh their gauges every 0.1 s
                metrics = by_role(scrape(server.metrics_url))
            out[routing] = (metrics["disagg_kv_reused_blocks"]["prefill"], metrics["disagg_kv_prompt_blocks"]["prefill"])
    finally:
        config.write_text(config.read_text().replace(ROUTING_PARAM.format(rendered), ROUTING_PARAM.format(routings[0])))
    return out


def _routing_repo(root: Path) -> Path:
    """cpu-tiny with reuse on every role and two prefill instances, built under `root`."""
    import yaml

    from disagg.cli import build
    from disagg.spec import load_spec

    raw = yaml.safe_load(Path("configs/cpu-tiny.yaml").read_text())
    for role in raw["roles"].values():
        role["enable_kv_cache_reuse"] = True
    raw["roles"]["prefill"]["instances"] = 2
    raw["output"] = {"build_dir": str(root), "model_repository": str(root / "model_repository")}
    path = root / "spec.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    spec = load_spec(path)
    build(spec, log=lambda _line: None)
    return spec.model_repository


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m disagg.bench prefix", description=__doc__)
    p.add_argument("--root", type=Path, default=Path("build"), help="where checkpoints and engines are cached")
    p.add_argument("--preset", default="bench-100mb")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="prompt length of (a) and (c); (b) grows to about it")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--no-routing", dest="routing", action="store_false", help="skip the served routing comparison")
    a = p.parse_args(argv)
    longest = a.prompt_tokens + 8 * a.answer_tokens + 8
    dirs = {reuse: build_engine(a.root, a.preset, 1, longest, a.answer_tokens, reuse=reuse) for reuse in (False, True)}
    engines = {reuse: LLMEngine(d) for reuse, d in dirs.items()}
    vocab = engines[False].config.model.vocab_size
    for engine in engines.values():
        _ttft(engine, "warm", tuple(range(2, 66)), 2)
    print(f"prefix: {a.preset}, reference engine, one request at a time, prompts of about {a.prompt_tokens} tokens, "
          f"{a.answer_tokens} answer tokens; TTFT in ms")
    print(f"{'workload':<26} {'p50 no reuse':>12} {'p50 reuse':>10} {'ratio':>6} | {'p95 no reuse':>12} {'p95 reuse':>10} {'ratio':>6} | "
          f"{'paired':>6} | {'hit rate':>8}")
    for name, conversations in workloads(a.prompt_tokens, a.requests, vocab).items():
        cached = engines[True]
        before = (cached.reused_blocks, cached.prompt_blocks)
        results = run_workload(engines, conversations, a.answer_tokens, name[:3])
        hit = (cached.reused_blocks - before[0]) / max(1, cached.prompt_blocks - before[1])
        figures = {reuse: np.percentile(np.asarray(ttfts) * 1e3, [50, 95]) for reuse, (ttfts, _) in results.items()}
        if results[True][1] != results[False][1]:
            raise SystemExit(f"prefix: {name}: the answers with reuse differ from those without")
        (p50, p95), (r50, r95) = figures[False], figures[True]
        paired = float(np.median(np.asarray(results[True][0]) / np.asarray(results[False][0])))
        print(f"{name:<26} {p50:>12.1f} {r50:>10.1f} {r50 / p50:>6.2f} | {p95:>12.1f} {r95:>10.1f} {r95 / p95:>6.2f} | "
              f"{paired:>6.2f} | {hit:>8.0%}")
    print("answers with reuse equal those without, token for token, in every workload")
    if a.routing:
        rates = routing_hit_rates(_routing_repo(a.root / "prefix-routing"))
        print("served, two prefill instances, 4 system prompts x 4 questions interleaved: prefill hit rate " +
              ", ".join(f"{routing} {used:.0f}/{seen:.0f} = {used / seen:.0%}" for routing, (used, seen) in rates.items()))
    return 0
