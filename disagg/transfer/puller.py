"""The decode side of the handoff: claims the blocks named by `context_phase_params`, copies, acknowledges.

Same node (`shm`): the prefill instance's KV pool is a shared-memory segment; the puller maps it
read-only by name, and the claim hands out a `PagedKV`: prefill's blocks in place, which decode copies
straight into its own reserved blocks. Across nodes (`tcp`): the agent sends the KV wire format, a
contiguous `SequenceKV`. Either way the KV is in the prefill engine's sharding; decode re-shards as it
copies. The ack that frees prefill's blocks comes after the copy, and fails if the lease ran out
meanwhile (the blocks may have been reused), so a torn copy is never used.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from multiprocessing.connection import Client, Connection

from disagg.engine.kv_cache import KVShape, KVStorage
from disagg.engine.kv_wire import SequenceKV
from disagg.engine.paged_kv import PagedKV
from disagg.transfer.params import ContextParamsError, ContextPhaseParams
from disagg.transfer.shm import attach, lineage


@dataclass(frozen=True)
class Claim:
    params: ContextPhaseParams
    kv: PagedKV | SequenceKV  # shm: prefill's blocks in place, readable until `ack`; tcp: a copy
    started: float  # perf_counter() when the claim was sent

    def contiguous(self) -> SequenceKV:
        """The KV out of prefill's blocks (a copy for shm; the fetched payload for tcp), still usable after `ack`."""
        return self.kv.gather() if isinstance(self.kv, PagedKV) else self.kv


@dataclass(frozen=True)
class PullResult:
    kv: SequenceKV
    nbytes: int
    seconds: float


class KVPuller:
    def __init__(self, timeout_s: float = 10.0):
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, str], Connection] = {}
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._lock = threading.Lock()

    def claim(self, params: ContextPhaseParams) -> Claim:
        """Extends the handoff's lease and gives access to its KV."""
        started = time.perf_counter()
        self._call(params, "claim")
        if params.transport == "shm":
            kv = self._map_shm(params)
        else:
            kv = SequenceKV.from_bytes(self._call(params, "fetch", expect_payload=True))
        return Claim(params, kv, started)

    def ack(self, claim: Claim) -> float:
        """Frees prefill's blocks; returns the seconds since the claim. Raises ContextParamsError when the
        handoff was no longer held (its lease ran out during the copy)."""
        self._call(claim.params, "ack")
        return time.perf_counter() - claim.started

    def pull(self, params: ContextPhaseParams) -> PullResult:
        """Claim, copy the KV out into a contiguous `SequenceKV`, ack."""
        claim = self.claim(params)
        kv = claim.contiguous()
        return PullResult(kv, kv.nbytes, self.ack(claim))

    def _map_shm(self, p: ContextPhaseParams) -> PagedKV:
        lay = p.layout
        stages = lay.mapping.stage_layers(lay.num_layers)
        shapes = [
            KVShape(len(stages[r // lay.tp_size]), p.num_blocks, lay.tokens_per_block, lay.num_kv_heads // lay.tp_size, lay.head_dim)
            for r in range(lay.tp_size * lay.pp_size)
        ]
        return PagedKV(KVStorage(shapes, self._segment(p.shm_name).buf), lay, tuple(p.block_ids), p.prompt_len)

    def _segment(self, name: str) -> shared_memory.SharedMemory:
        with self._lock:
            seg = self._segments.get(name)
            if seg is None:
                try:
                    seg = attach(name)
                except FileNotFoundError:
                    raise ContextParamsError(f"context_phase_params: shared memory segment {name!r} does not exist") from None
                for old in [n for n in self._segments if lineage(n) == lineage(name)]:  # a restarted prefill's predecessor
                    self._close(self._segments.pop(old))
                self._segments[name] = seg
            return seg

    def _call(self, p: ContextPhaseParams, op: str, expect_payload: bool = False):
        key = (p.agent, p.token)
        with self._lock:
            conn = self._conns.get(key)
            if conn is None:
                conn = self._connect(p)
                self._conns[key] = conn
            try:
                conn.send_bytes(json.dumps({"op": op, "id": p.request_id}).encode())
                if not conn.poll(self.timeout_s):
                    raise ContextParamsError(f"context_phase_params: transfer agent {p.agent} did not answer {op!r} within {self.timeout_s} s")
                reply = json.loads(conn.recv_bytes())
                payload = conn.recv_bytes() if expect_payload and reply.get("ok") else None
            except (EOFError, OSError) as exc:
                self._conns.pop(key, None)
                raise ContextParamsError(f"context_phase_params: transfer agent {p.agent} dropped the connection ({exc!r})") from None
        if not reply.get("ok"):
            raise ContextParamsError(f"context_phase_params: stale handoff: {reply.get('error')}")
        return payload

    def _connect(self, p: ContextPhaseParams) -> Connection:
        host, _, port = p.agent.rpartition(":")
        try:
            return Client((host, int(port)), authkey=p.token.encode())
        except ValueError:
            raise ContextParamsError(f"context_phase_params: agent address {p.agent!r} is not host:port") from None
        except (ConnectionRefusedError, OSError) as exc:
            raise ContextParamsError(f"context_phase_params: cannot reach transfer agent {p.agent} ({exc.__class__.__name__})") from None
        except Exception as exc:  # AuthenticationError: the blob's token is not this agent's
            raise ContextParamsError(f"context_phase_params: transfer agent {p.agent} rejected the token ({exc.__class__.__name__})") from None

    def close(self) -> None:
        with self._lock:
            for conn in self._conns.values():
                conn.close()
            for seg in self._segments.values():
                self._close(seg)
            self._conns.clear()
            self._segments.clear()

    @staticmethod
    def _close(seg: shared_memory.SharedMemory) -> None:
        try:
            seg.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with the process
            pass
