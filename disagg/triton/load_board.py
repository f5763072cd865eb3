"""Engine instances publish their load; the orchestrator reads it to send each request to the least
loaded decode model.

A board is a directory of small JSON files, one per engine instance, rewritten atomically every
refresh (default: /dev/shm, i.e. memory). The board key is derived from the model repository's path,
so two servers on one machine never read each other's load.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

STALE_S = 2.0


def board_dir() -> Path:
    return Path(os.environ.get("DISAGG_LOAD_BOARD", "/dev/shm"))


def board_key(repository_root: Path) -> str:
    return hashlib.sha256(str(Path(repository_root).resolve()).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Load:
    in_flight: int
    free_blocks: int
    updated: float


def _path(key: str, model: str, instance: str) -> Path:
    return board_dir() / f"disagg-load-{key}-{model}-{instance}.json"


def publish(key: str, model: str, instance: str, in_flight: int, free_blocks: int) -> None:
    path = _path(key, model, instance)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(Load(in_flight, free_blocks, time.time()))))
    os.replace(tmp, path)


def withdraw(key: str, model: str, instance: str) -> None:
    _path(key, model, instance).unlink(missing_ok=True)


def model_load(key: str, model: str) -> Load | None:
    """The model's load summed over its instances; None when no instance published recently."""
    now, loads = time.time(), []
    for path in board_dir().glob(f"disagg-load-{key}-{model}-*.json"):
        try:
            load = Load(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now, or not ours
        if now - load.updated < STALE_S:
            loads.append(load)
    if not loads:
        return None
    return Load(sum(x.in_flight for x in loads), sum(x.free_blocks for x in loads), max(x.updated for x in loads))


def least_loaded(key: str, models: list[str], dispatched: dict[str, int]) -> str:
    """Fewest sequences in flight first, then most free KV blocks. `dispatched` counts requests this
    orchestrator sent and still streams, which covers the time before the board shows them."""
    def score(model: str) -> tuple[int, int]:
        load = model_load(key, model)
        in_flight = max(load.in_flight if load else 0, dispatched.get(model, 0))
        return in_flight, -(load.free_blocks if load else 0)

    return min(models, key=score)
