"""Readiness that tells the truth: Triton keeps a model READY after its stub process died, so its own
`/v2/health/ready` stays true while every request fails. Ready here means the server is ready and every
engine role has at least one live instance: its process exists and it published on the load board within
`load_board.STALE_S` (a stopped or hung instance stops publishing). With two decode instances and one
dead, the deployment still serves, so it stays ready; the report says which instance is down.

Only the reference engines publish; a repository of tensorrtllm-backend engines is judged by Triton's
readiness alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from disagg.repository import instance_count, parse_config
from disagg.triton import load_board


@dataclass(frozen=True)
class EngineModel:
    name: str
    role: str
    instances: int


def engine_models(model_repository: str | Path) -> list[EngineModel]:
    """The reference-engine models of a repository (Python models with a `role` parameter)."""
    found = []
    for path in sorted(Path(model_repository).glob("*/config.pbtxt")):
        config = parse_config(path.parent.name, path.read_text())
        role = config.parameters.get("role")
        if config.backend == "python" and role is not None:
            found.append(EngineModel(config.name, role.string_value, instance_count(config)))
    return found


def report(key: str, engines: list[EngineModel], server_ready: bool) -> dict:
    """{"ready": bool, "server_ready": bool, "engines": {model: {role, instances, alive}}, "restarts": {...}}"""
    alive = {}
    for engine in engines:
        alive[engine.name] = sum(e.fresh and e.process_alive for e in load_board.entries(key, engine.name))
    roles = {e.role for e in engines}
    serving = all(any(alive[e.name] for e in engines if e.role == role) for role in roles)
    return {
        "ready": server_ready and serving,
        "server_ready": server_ready,
        "engines": {e.name: {"role": e.role, "instances": e.instances, "alive": alive[e.name]} for e in engines},
        "restarts": load_board.restarts(key),
    }
