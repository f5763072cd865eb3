"""Shared-memory KV pools: a prefill instance allocates its pool here, decode instances map it by name.

Python (< 3.13) registers every mapped segment with the process's resource tracker, which unlinks it
when the process exits: a decode instance must therefore unregister the segments it only attaches,
or its exit would destroy the prefill instance's pool. Segments created in this process are left
registered (their owner unlinks them).

A pool is named `<lineage>_<pid>`: an engine instance restarted after a crash gets a new name, so a
decode instance never reads a dead predecessor's blocks through a mapping it kept, and drops that mapping
when it first maps the successor (same lineage).
"""
from __future__ import annotations

import os
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

_CREATED_HERE: set[str] = set()


class SharedPool:
    """`LLMEngine(engine_dir, kv_buffer=pool.allocate)` puts the engine's KV pool in shared memory."""

    def __init__(self, name: str | None = None):
        self.requested_name = name
        self.segment: shared_memory.SharedMemory | None = None

    def allocate(self, nbytes: int):
        self.segment = shared_memory.SharedMemory(create=True, size=nbytes, name=self.requested_name)
        _CREATED_HERE.add(self.segment.name)
        return self.segment.buf

    @property
    def name(self) -> str:
        return self.segment.name if self.segment else ""

    def unlink(self) -> None:
        if self.segment is not None:
            self.segment.unlink()
            _CREATED_HERE.discard(self.segment.name)


def attach(name: str) -> shared_memory.SharedMemory:
    """Maps an existing segment without taking ownership of it. Raises FileNotFoundError."""
    segment = shared_memory.SharedMemory(name=name)
    if segment.name not in _CREATED_HERE:
        resource_tracker.unregister(segment._name, "shared_memory")  # noqa: SLF001
    return segment


def pool_name(lineage: str) -> str:
    """This process's pool name in `lineage` (one engine instance of one deployment)."""
    return f"{lineage}_{os.getpid()}"


def lineage(name: str) -> str:
    return name.rsplit("_", 1)[0]


def unlink_predecessors(lineage_name: str, shm_dir: Path = Path("/dev/shm")) -> None:
    """Removes pools of earlier processes in `lineage_name` (killed before they could remove their own);
    their memory is freed once no process maps them."""
    for path in shm_dir.glob(f"{lineage_name}_*"):
        if path.name.rsplit("_", 1)[1].isdigit():
            path.unlink(missing_ok=True)
