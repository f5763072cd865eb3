"""Shared-memory KV pools: a prefill instance allocates its pool here, decode instances map it by name.

Python (< 3.13) registers every mapped segment with the process's resource tracker, which unlinks it
when the process exits: a decode instance must therefore unregister the segments it only attaches,
or its exit would destroy the prefill instance's pool. Segments created in this process are left
registered (their owner unlinks them).
"""
from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

_CREATED_HERE: set[str] = set()


class SharedPool:
    """`LLMEngine(engine_dir, kv_buffer=pool.allocate)` puts the engine's KV pool in shared memory."""

    def __init__(self, name: str | None = None):
        self.requested_name = name
        self.segment: shared_memory.SharedMemory | None = None

    def allocate(self, nbytes: int):
        try:
            self.segment = shared_memory.SharedMemory(create=True, size=nbytes, name=self.requested_name)
        except FileExistsError:  # a killed predecessor's pool under this instance's name: nobody owns it now
            stale = shared_memory.SharedMemory(name=self.requested_name)
            stale.close()
            stale.unlink()
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
