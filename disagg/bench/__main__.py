"""python -m disagg.bench {engine,corun,serving,front,prefix,clients,sla} [options]"""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disagg.bench", description=__doc__)
    parser.add_argument("which", choices=["engine", "corun", "serving", "front", "prefix", "clients", "sla"], help="engine: prefill/decode throughput vs roofline; "
                        "corun: engine steps alone vs beside other processes (wall time and CPU per step); "
                        "serving: orchestration overhead and KV handoff bandwidth; front: the front's cost and ceiling with engine "
                        "compute skipped; prefix: TTFT with prefix reuse vs without; clients: genai-perf and AIPerf on both ensembles; "
                        "sla: two classes of traffic over a fast and a slow pool, service-class routing vs round-robin and least-loaded")
    args, rest = parser.parse_known_args(argv)
    if args.which == "engine":
        from disagg.bench.engine import main as run
    elif args.which == "corun":
        from disagg.bench.corun import main as run
    elif args.which == "serving":
        from disagg.bench.serving import main as run
    elif args.which == "front":
        from disagg.bench.front import main as run
    elif args.which == "prefix":
        from disagg.bench.prefix import main as run
    elif args.which == "sla":
        from disagg.bench.sla import main as run
    else:
        from disagg.bench.clients import main as run
    return run(rest)


if __name__ == "__main__":
    sys.exit(main())
