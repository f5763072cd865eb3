"""A host-memory store of prefix KV blocks shared by the engine instances of one node.

An instance with prefix reuse publishes every full block it computes (named by its hash chain,
disagg.engine.kv_cache.block_hashes) and, when a prompt's prefix is not in its own cache, imports the
blocks the store has before computing the rest, so a prefix computed by one instance serves them all.
Blocks are files in a directory (/dev/shm: memory), named `<prefix>t<block size>-<hash>.kv` (the prefix
names the deployment, so its sweep removes them), each one block's KV in the handoff's wire format
(disagg.engine.kv_wire.SequenceKV), token-major: an importer of another TP/PP layout or block size
converts it as a decode engine converts a handoff (disagg.engine.engine assembles its own blocks from
the publisher's). Writers never clash: a block is written to a private temporary file
and renamed into place (disagg.atomic_file), and two writers of one hash write the same bytes. Bounded by bytes: a write that
takes the store over `capacity_bytes` removes the least recently used blocks (a read refreshes a block's
time) until it fits again; with a tier `below` (a directory on disk, for capacity), they move down to it
instead, and a block found only there moves back up when read. The disk tier outlives the deployment, so
the caller names its directory by the model's weights: other weights never read it.
"""
from __future__ import annotations

import os
from pathlib import Path

from disagg.atomic_file import replace_file
from disagg.engine.kv_wire import KVFormatError, SequenceKV


class KVStore:
    def __init__(self, directory: Path, prefix: str, capacity_bytes: int, below: KVStore | None = None):
        self.directory, self.prefix = Path(directory), prefix
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.below = below
        self.written = self.evicted = 0  # by this process: blocks put, blocks removed (or moved down) to make room

    def _path(self, size: int, block_hash: int) -> Path:
        return self.directory / f"{self.prefix}t{size}-{block_hash:016x}.kv"

    def contains(self, size: int, block_hash: int) -> bool:
        """Whether a block of `size` tokens with that hash is stored, in this tier or below."""
        return self._path(size, block_hash).is_file() or (self.below is not None and self.below.contains(size, block_hash))

    def _key(self, name: str) -> tuple[int, int]:
        """(block size, hash) of a block file's name, as `_path` writes it."""
        size, block_hash = name[len(self.prefix) + 1 : -len(".kv")].split("-")
        return int(size), int(block_hash, 16)

    def _block_files(self):
        """This tier's block files (os.DirEntry), not the temporaries being written."""
        return (e for e in os.scandir(self.directory) if e.name.startswith(self.prefix) and e.name.endswith(".kv"))

    def sizes(self) -> set[int]:
        """The block sizes blocks are stored in (publishers may differ in tokens_per_block)."""
        found = {self._key(e.name)[0] for e in self._block_files()}
        return found | (self.below.sizes() if self.below is not None else set())

    def get(self, size: int, block_hash: int) -> SequenceKV | None:
        """The block's KV, or None when it is not (or no longer) stored in this tier or below."""
        raw = self._read(size, block_hash)
        if raw is None and self.below is not None:
            raw = self.below._read(size, block_hash)
            if raw is not None:
                self._write(size, block_hash, raw)  # back up: it is in use again
        try:
            return None if raw is None else SequenceKV.from_bytes(raw)
        except KVFormatError:  # not a block of ours
            self._path(size, block_hash).unlink(missing_ok=True)
            return None

    def put(self, size: int, block_hash: int, kv: SequenceKV) -> None:
        path = self._path(size, block_hash)
        if path.is_file():
            os.utime(path)
            return
        self._write(size, block_hash, kv.to_bytes())

    def _read(self, size: int, block_hash: int) -> bytes | None:
        path = self._path(size, block_hash)
        try:
            raw = path.read_bytes()
            os.utime(path)  # recently used
            return raw
        except FileNotFoundError:
            return None

    def _write(self, size: int, block_hash: int, raw: bytes) -> None:
        replace_file(self._path(size, block_hash), raw)
        self.written += 1
        self._fit()

    def _fit(self) -> None:
        blocks = []
        for entry in self._block_files():
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # removed by another instance meanwhile
            blocks.append((st.st_mtime_ns, st.st_size, entry.path, entry.name))
        total = sum(size for _, size, _, _ in blocks)
        for _, size, path, name in sorted(blocks):
            if total <= self.capacity_bytes:
                break
            try:
                if self.below is not None:
                    self.below._write(*self._key(name), Path(path).read_bytes())
                os.unlink(path)
                self.evicted += 1
            except FileNotFoundError:
                pass  # removed (or moved down) by another instance meanwhile
            total -= size

    def nbytes(self) -> int:
        return sum(e.stat().st_size for e in self._block_files())

