"""python -m disagg.bench {engine,corun,serving,front,prefix,clients,sla} [--help | options]"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "engine": "prefill/decode throughput vs roofline",
    "corun": "engine steps alone vs beside other processes (wall time and CPU per step)",
    "serving": "orchestration overhead and KV handoff bandwidth",
    "front": "the front's cost and ceiling with engine compute skipped",
    "prefix": "TTFT with prefix reuse vs without",
    "clients": "genai-perf and AIPerf on both ensembles",
    "sla": "two classes of traffic over a fast and a slow pool, service-class routing vs round-robin and least-loaded",
}


def main(argv: list[str] | None = None) -> int:
    """Runs disagg.bench.<command>'s main with the rest of the arguments: its own --help among them."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        return importlib.import_module(f"disagg.bench.{argv[0]}").main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m disagg.bench", description=__doc__)
    parser.add_argument("which", choices=list(COMMANDS), help="; ".join(f"{name}: {what}" for name, what in COMMANDS.items()))
    parser.parse_args(argv)  # --help, or an error naming the commands
    return 2


if __name__ == "__main__":
    sys.exit(main())
