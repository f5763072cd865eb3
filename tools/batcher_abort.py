"""Shows the Triton 2.51 server abort that the repository's decoupled Python models avoid by having no dynamic batcher.

Builds `python -m disagg.bench front`'s repository (cpu-tiny with tensorrt_llm_bls, room for 64 streams) and
serves it with the engines' compute skipped (20 ms steps, off the CPU), twice, each time on a fresh server:

    batched    `dynamic_batching { }` put back into every decoupled Python model (engines, orchestrators,
               tensorrt_llm_bls), as their configs had it until this fix
    rendered   the configs as build-engines renders them: no dynamic batcher in front of any Python model

Each way keeps `--streams` requests in flight through `ensemble`, then `tensorrt_llm_bls`, `--seconds` each, in
turn, until `--minutes` have passed or the server stops answering, and prints how long it served, how many
rounds and tokens, and the fatal lines of its log (`malloc(): ...`, `Signal (...)`), if any.

    python -m tools.batcher_abort                 # 15 minutes a way at most
"""
from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from disagg.bench.front import FRONTS, PROMPT, Driver, front_spec
from disagg.cli import build
from disagg.engine.no_compute import skipped_compute
from disagg.serve.server import TritonServer
from disagg.text import encode_prompt, load_tokenizer

DECOUPLED = "model_transaction_policy { decoupled: true }\n"
FATAL = re.compile(r"malloc|free\(\)|corrupted|double free|Signal \((?!15\))|ASSERTION FAILED")  # 15: our own stop


def put_back_batcher(repository: Path) -> list[str]:
    """Adds `dynamic_batching { }` to every decoupled Python model of `repository`; returns their names."""
    changed = []
    for config in sorted(repository.glob("*/config.pbtxt")):
        text = config.read_text()
        if 'backend: "python"' in text and DECOUPLED in text:
            config.write_text(text.replace(DECOUPLED, DECOUPLED + "dynamic_batching { }\n"))
            changed.append(config.parent.name)
    return changed


def serve(repository: Path, ids: list[int], minutes: float, streams: int, seconds: float, log: Path) -> dict:
    """The fronts in turn until `minutes` have passed or a row fails; what the server did meanwhile."""
    start = time.monotonic()
    rounds, tokens, failure = 0, 0, None
    log.unlink(missing_ok=True)
    with skipped_compute(20), TritonServer(repository, log_path=log) as server:
        driver = Driver(server.grpc_url, server.internal_key, ids, 64, server.process.pid)
        try:
            while failure is None and time.monotonic() - start < minutes * 60:
                for front in FRONTS:
                    try:
                        row = driver.run(front, streams, seconds)
                    except RuntimeError as exc:
                        failure = str(exc)
                        break
                    tokens += driver.tokens_in_window
                    gone = server.process.poll() is not None
                    if row.errors or gone:
                        failure = f"{front}: {row.errors} errors, the server {'gone' if gone else 'still up'}"
                        break
                else:
                    rounds += 1
                    print(f"    {(time.monotonic() - start) / 60:5.1f} min: {rounds} rounds", flush=True)
        finally:
            driver.close()
    fatal = [line.strip() for line in log.read_text(errors="replace").splitlines() if FATAL.search(line)]
    return {"minutes": (time.monotonic() - start) / 60, "rounds": rounds, "tokens": tokens, "failure": failure, "fatal": fatal}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=15.0, help="the longest a way is served")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0, help="each front's turn")
    ap.add_argument("--ways", default="batched,rendered")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="batcher-abort-") as tmp:
        results = {}
        for way in args.ways.split(","):
            spec = front_spec(Path("configs/cpu-tiny.yaml"), Path(tmp) / way, args.streams)
            build(spec, log=lambda _msg: None)
            if way == "batched":
                print(f"  batched: dynamic_batching put back into {', '.join(put_back_batcher(spec.model_repository))}")
            ids = encode_prompt(load_tokenizer(spec.model.path), PROMPT)
            print(f"  {way}: {args.streams} streams through {' and '.join(FRONTS)} in turn, {args.minutes:g} minutes at most", flush=True)
            results[way] = serve(spec.model_repository, ids, args.minutes, args.streams, args.seconds, Path(tmp) / f"{way}.log")
        print(f"\n  {'way':<10}{'minutes':>12}{'rounds':>8}{'tokens':>10}  outcome")
        for way, r in results.items():
            outcome = "served to the end" if r["failure"] is None else f"stopped: {r['failure'][:100]}"
            print(f"  {way:<10}{r['minutes']:>12.1f}{r['rounds']:>8}{r['tokens']:>10}  {outcome}")
            for line in dict.fromkeys(r["fatal"]):  # each fatal line once, in order
                print(f"  {'':<10}log: {line}")


if __name__ == "__main__":
    main()
