"""The prefill side of the handoff: holds finished context-phase KV until decode has pulled it.

One agent per prefill model instance listens on a loopback TCP port (another address only when the
spec says so) and authenticates peers with a per-process token (`multiprocessing.connection`'s HMAC
challenge). Messages are JSON, never pickles:

    {"op": "claim", "id": ...}  -> the lease is extended while decode copies (shm) ...
    {"op": "fetch", "id": ...}  -> ... or the agent sends the KV wire bytes (tcp)
    {"op": "ack",   "id": ...}  -> answered at once (the lease held through the copy), blocks freed after
A handoff nobody acknowledges is reclaimed when its lease expires, so a crashed decode or an
orchestrator that gave up never leaks prefill blocks. Freeing waits for the engine's step in flight (a
prompt's chunk: hundreds of ms on a busy CPU), so acknowledged blocks are freed on a thread of their own:
each decode instance's messages share one connection, and its next claim or ack must not wait behind that.
"""
from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from multiprocessing.connection import Connection, Listener

from disagg.engine.engine import StepOutput
from disagg.engine.loop import EngineLoop
from disagg.transfer.params import ContextPhaseParams


class TransferAgent:
    def __init__(self, loop: EngineLoop, transport: str, shm_name: str = "", bind: str = "127.0.0.1", lease_s: float = 30.0):
        self.loop = loop
        self.transport = transport
        self.shm_name = shm_name
        self.lease_s = lease_s
        self.token = secrets.token_hex(16)
        self._num_blocks, self._layout = loop.call(lambda engine: (engine.blocks.num_blocks, engine.layout))
        self._listener = Listener((bind, 0), authkey=self.token.encode())
        host, port = self._listener.address
        self.address = f"{host}:{port}"
        self._leases: dict[str, float] = {}  # request id -> deadline (monotonic)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.reclaimed = 0  # handoffs freed by lease expiry, for metrics
        # Held while a lease expiry frees its blocks and is counted, so that whoever reads the pool's state
        # and `reclaimed` under it never sees the blocks free but the expiry not yet counted.
        self.reaping = threading.Lock()
        threading.Thread(target=self._accept, name="kv-agent-accept", daemon=True).start()
        threading.Thread(target=self._reap, name="kv-agent-lease", daemon=True).start()
        self._acknowledged: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        threading.Thread(target=self._free_acknowledged, name="kv-agent-free", daemon=True).start()

    def hold(self, output: StepOutput) -> ContextPhaseParams:
        """Starts the lease of a finished context-only sequence and describes it for decode, from its
        context-phase result (the engine is not read: its next step may be under way)."""
        with self._lock:
            self._leases[output.req_id] = time.monotonic() + self.lease_s
        return ContextPhaseParams(
            request_id=output.req_id,
            first_token=output.token,
            prompt_len=output.held.tokens,
            agent=self.address,
            token=self.token,
            transport=self.transport,
            shm_name=self.shm_name,
            block_ids=output.held.block_ids,
            num_blocks=self._num_blocks,
            layout=self._layout,
        )

    def drop(self, req_id: str) -> bool:
        """Frees a held handoff now (acknowledged, cancelled, or no decode needed)."""
        with self._lock:
            self._leases.pop(req_id, None)
        return self.loop.release(req_id)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._leases)

    def close(self) -> None:
        self._closed.set()
        self._acknowledged.put(None)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn = self._listener.accept()
            except Exception:  # noqa: BLE001 - failed handshakes (wrong token) and close() land here
                continue
            threading.Thread(target=self._serve, args=(conn,), name="kv-agent-conn", daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        with conn:
            while not self._closed.is_set():
                try:
                    msg = json.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    return
                req_id = msg.get("id", "")
                with self._lock:
                    known = req_id in self._leases
                    if known and msg.get("op") == "claim":
                        self._leases[req_id] = time.monotonic() + self.lease_s
                if not known:
                    conn.send_bytes(json.dumps({"ok": False, "error": f"handoff {req_id!r} is not held here (already consumed, or its lease expired)"}).encode())
                elif msg.get("op") == "fetch":
                    payload = self.loop.call(lambda e: e.export_kv(req_id).to_bytes())
                    conn.send_bytes(json.dumps({"ok": True, "nbytes": len(payload)}).encode())
                    conn.send_bytes(payload)
                elif msg.get("op") == "ack":  # the copy is good: its lease held until now
                    with self._lock:
                        self._leases.pop(req_id, None)
                    conn.send_bytes(b'{"ok": true}')
                    self._acknowledged.put(req_id)
                else:
                    conn.send_bytes(b'{"ok": true}')

    def _free_acknowledged(self) -> None:
        while (req_id := self._acknowledged.get()) is not None:
            self.loop.release(req_id)

    def _reap(self) -> None:
        while not self._closed.wait(min(1.0, self.lease_s / 4)):
            now = time.monotonic()
            with self._lock:
                expired = [r for r, deadline in self._leases.items() if deadline < now]
            for req_id in expired:
                with self.reaping:
                    if self.drop(req_id):
                        self.reclaimed += 1
