"""`context_phase_params`: the small, versioned blob a context-only response carries to decode.

It says where the KV is and how it is laid out, never the KV itself:

    b"DCPP" | u16 version | JSON {request_id, first_token, prompt_len, agent, token, shm, block_ids, layout, ...}

A forged blob fails to decode or fails the agent's token check; a stale one names a handoff the
agent no longer holds. Either way decode refuses it with a message naming `context_phase_params`.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass

from disagg.engine.kv_wire import KVLayout

MAGIC = b"DCPP"
VERSION = 1
_PREFIX = struct.Struct("<4sH")


class ContextParamsError(ValueError):
    pass


@dataclass(frozen=True)
class ContextPhaseParams:
    request_id: str  # the prefill engine's id for the held sequence
    first_token: int
    prompt_len: int
    agent: str  # "host:port" of the prefill instance's transfer agent
    token: str  # capability: the agent serves only blobs carrying its token
    transport: str  # "shm" (read the prefill pool directly) or "tcp" (the agent sends the bytes)
    shm_name: str  # the prefill pool's shared memory segment ("" for tcp)
    block_ids: tuple[int, ...]
    num_blocks: int  # blocks in the prefill pool, to map its arrays
    layout: KVLayout

    def to_bytes(self) -> bytes:
        body = asdict(self)
        body["block_ids"] = list(self.block_ids)
        return _PREFIX.pack(MAGIC, VERSION) + json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ContextPhaseParams:
        if len(data) < _PREFIX.size:
            raise ContextParamsError(f"context_phase_params: {len(data)} bytes is too short to be a handoff blob")
        magic, version = _PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise ContextParamsError(f"context_phase_params: not a handoff blob (starts with {bytes(magic)!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise ContextParamsError(f"context_phase_params: blob version {version}, this build reads version {VERSION}")
        try:
            body = json.loads(data[_PREFIX.size :])
            body["layout"] = KVLayout(**body["layout"])
            body["block_ids"] = tuple(int(b) for b in body["block_ids"])
            return cls(**body)
        except (ValueError, TypeError, KeyError) as exc:
            raise ContextParamsError(f"context_phase_params: malformed blob ({exc})") from exc
