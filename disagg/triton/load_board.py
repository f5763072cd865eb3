"""Engine instances publish their load and that they are alive; the orchestrator reads it to send each
request to the least loaded live instance and to fail a request fast when the instance serving it dies,
the watchdog to bring a dead instance back, the readiness check to tell the truth.

A board is a directory of small JSON files, one per engine instance, rewritten atomically every
refresh (default: /dev/shm, i.e. memory), carrying the instance's process id. The board key is derived
from the model repository's path, so two servers on one machine never read each other's load.
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
    pid: int = 0  # the engine instance's process (its Python backend stub)


@dataclass(frozen=True)
class Entry:
    """One instance's latest publication."""

    model: str
    instance: str
    load: Load

    @property
    def process_alive(self) -> bool:
        return pid_alive(self.load.pid)

    @property
    def fresh(self) -> bool:
        return time.time() - self.load.updated < STALE_S


def process_state(pid: int) -> str | None:
    """The state letter of process `pid` in /proc (R, S, D, T for stopped, Z for a zombie ...); None when
    there is no such process."""
    if pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed stub stays one until Triton reaps it)."""
    return process_state(pid) not in (None, "Z")


def _path(key: str, model: str, instance: str) -> Path:
    return board_dir() / f"disagg-load-{key}-{model}-{instance}.json"


def publish(key: str, model: str, instance: str, in_flight: int, free_blocks: int) -> None:
    path = _path(key, model, instance)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(Load(in_flight, free_blocks, time.time(), os.getpid()))))
    os.replace(tmp, path)


def entries(key: str, model: str | None = None) -> list[Entry]:
    """What every instance of `model` (None: of every model) last published. Names hold no "-", so a
    file's name splits into model and instance there."""
    found = []
    for path in board_dir().glob(f"disagg-load-{key}-{model or '*'}-*.json"):
        owner, instance = path.stem.removeprefix(f"disagg-load-{key}-").split("-", 1)
        try:
            found.append(Entry(owner, instance, Load(**json.loads(path.read_text()))))
        except (OSError, ValueError, TypeError):
            continue  # being replaced right now, or not ours
    return found


def withdraw(key: str, model: str, instance: str) -> None:
    _path(key, model, instance).unlink(missing_ok=True)


def model_load(key: str, model: str) -> Load | None:
    """The model's load summed over its live instances; None when none published recently."""
    loads = [e.load for e in entries(key, model) if e.fresh and e.process_alive]
    if not loads:
        return None
    return Load(sum(x.in_flight for x in loads), sum(x.free_blocks for x in loads), max(x.updated for x in loads))


def load_score(key: str, model: str, dispatched: dict[str, int]) -> tuple[bool, int, int]:
    """(an instance is known dead, sequences in flight, -free KV blocks) of `model`. `dispatched` counts
    requests this orchestrator sent and still streams, which covers the time before the board shows them."""
    published = entries(key, model)  # read once: liveness and load come from the same files
    live = [e.load for e in published if e.fresh and e.process_alive]
    dead = any(e.load.pid and not e.process_alive for e in published)
    in_flight = max(sum(x.in_flight for x in live), dispatched.get(model, 0))
    return dead, in_flight, -sum(x.free_blocks for x in live)


def least_loaded(key: str, models: list[str], dispatched: dict[str, int]) -> str:
    """A model none of whose instances is known dead, if there is one; among those, fewest sequences in
    flight first, then most free KV blocks (`load_score`)."""
    return min(models, key=lambda model: load_score(key, model, dispatched))


def _restarts_path(key: str) -> Path:
    return board_dir() / f"disagg-restarts-{key}.json"


def restarts(key: str) -> dict[str, int]:
    """How many times each model was reloaded after an instance died (disagg.serve.watchdog)."""
    try:
        return json.loads(_restarts_path(key).read_text())
    except (OSError, ValueError):
        return {}


def count_restart(key: str, model: str) -> None:
    counts = restarts(key)
    counts[model] = counts.get(model, 0) + 1
    path = _restarts_path(key)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(counts))
    os.replace(tmp, path)
