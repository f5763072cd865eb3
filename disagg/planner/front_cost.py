"""What the front (tokenizing, orchestrating, detokenizing, streaming) needs of a host's CPU at a token rate.

The front is this project's Python on every deployment, GPU or not, so its CPU per output token, measured by
`python -m disagg.bench front` (engines skipping compute, `<out>/front.json`), sizes it for any token rate on a
host as fast as the one measured. Counted as the front: its Python models' stubs, and what tritonserver spends
on that path beyond what it spends serving the same tokens straight from the engines. Not counted: the engine
models' stubs (the tensorrtllm backend's own work on GPUs) and the load generator. A Python process holds one
GIL, so each Python model needs at least as many instances as the cores it would keep busy.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

DIRECT = "prefill + decode"  # bench front's path of the engines called directly
ENGINE_STUBS = frozenset({"stub prefill", "stub decode", "stub aggregated_engine"})
MIN_MS = 0.02  # a stub spending less per token is a model of another path, idle beside this one
SHOWN_MS = 0.005  # a process spending less per token is left out of a printed breakdown


@dataclass(frozen=True)
class FrontCost:
    """CPU ms per output token of one path at one level of `bench front`, by front process."""

    path: str
    streams: int
    ms_per_token: dict[str, float]
    source: Path

    @property
    def total_ms(self) -> float:
        return sum(self.ms_per_token.values())

    def cores(self, tokens_per_s: float) -> float:
        """The cores the front keeps busy at `tokens_per_s`."""
        return tokens_per_s * self.total_ms / 1e3

    def instances(self, tokens_per_s: float) -> dict[str, int]:
        """Per Python model of the path (those that spent at least MIN_MS a token), the instances it needs at
        `tokens_per_s`: one core at most each."""
        return {name.removeprefix("stub "): max(1, math.ceil(tokens_per_s * ms / 1e3)) for name, ms in self.ms_per_token.items()
                if name.startswith("stub ") and ms >= MIN_MS}


def shares(ms_per_token: dict[str, float]) -> list[tuple[str, float]]:
    """The processes worth printing of a per-token breakdown, the costliest first."""
    return sorted(((name, ms) for name, ms in ms_per_token.items() if ms >= SHOWN_MS), key=lambda kv: (kv[1], kv[0]), reverse=True)


def front_cost(source: Path, path: str) -> FrontCost:
    """`path`'s cost at the highest level `bench front` measured it and the engines called directly."""
    rows = json.loads(source.read_text())["rows"]
    levels = {r["streams"] for r in rows if r["path"] == path} & {r["streams"] for r in rows if r["path"] == DIRECT}
    if not levels:
        raise SystemExit(f"error: {source}: no level measured both through {path} and with the engines called directly")
    top = max(levels)
    at_top = {r["path"]: r["cpu_ms_per_token"] for r in rows if r["streams"] == top}
    front, direct = at_top[path], at_top[DIRECT]
    costs = {name: ms for name, ms in front.items() if name.startswith("stub ") and name not in ENGINE_STUBS}
    costs["tritonserver"] = max(0.0, front.get("tritonserver", 0.0) - direct.get("tritonserver", 0.0))
    return FrontCost(path, top, costs, source)
