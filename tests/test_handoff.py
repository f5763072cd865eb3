"""KV handoff below the Triton boundary: prefill pool in shared memory (or TCP), agent leases, puller errors."""
from __future__ import annotations

import threading
import time

import pytest
from engine_helpers import EngineFactory

from disagg.engine.engine import ContextPhase, LLMEngine, Request
from disagg.engine.loop import EngineLoop
from disagg.transfer.agent import TransferAgent
from disagg.transfer.params import ContextParamsError, ContextPhaseParams
from disagg.transfer.puller import KVPuller
from disagg.transfer.shm import SharedPool


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("handoff"))


class Prefill:
    """A prefill engine whose KV pool is a shared-memory segment, with its transfer agent."""

    def __init__(self, engine_dir, transport="shm", lease_s=30.0):
        self.pool = SharedPool()
        engine = LLMEngine(engine_dir, kv_buffer=self.pool.allocate if transport == "shm" else None)
        self.loop = EngineLoop(engine)
        self.agent = TransferAgent(self.loop, transport, self.pool.name, lease_s=lease_s)

    def context(self, req_id, prompt, max_new) -> ContextPhaseParams:
        done = threading.Event()
        first = []

        def on_output(o):
            first.append(o)
            done.set()

        self.loop.submit(Request(req_id, prompt, max_new, "context_only"), on_output)
        assert done.wait(10)
        return self.agent.hold(first[0])

    def close(self):
        self.agent.close()
        self.loop.stop()
        self.pool.unlink()


PROMPT = tuple(range(3, 43))


def _freed(prefill: Prefill) -> bool:
    """Whether the prefill engine frees every block within 5 s (an ack is answered before its blocks are freed)."""
    deadline = time.monotonic() + 5
    while prefill.loop.stats().blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefill.loop.stats().blocks_used == 0


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("decode_tp_pp", [(1, 1), (2, 2)])
def test_pulled_kv_continues_exactly_as_aggregated(factory, transport, decode_tp_pp):
    expected = factory.engine().generate([Request("a", PROMPT, 10)])["a"]
    prefill = Prefill(factory.engine_dir(2, 1, role="prefill"), transport)
    try:
        params = ContextPhaseParams.from_bytes(prefill.context("r1", PROMPT, 10).to_bytes())
        assert params.first_token == expected[0] and len(params.block_ids) == 3  # 40 tokens, 16 per block
        assert prefill.loop.stats().blocks_used == 3
        pulled = KVPuller().pull(params)
        assert pulled.nbytes == 4 * 2 * 40 * 4 * 8 * 4  # layers * k|v * tokens * kv heads * head dim * fp32
        assert prefill.agent.num_held == 0 and _freed(prefill)
        decode = factory.engine(*decode_tp_pp, role="decode")
        ctx = ContextPhase(params.first_token, pulled.kv)
        assert decode.generate([Request("r1", PROMPT, 10, "generation_only", context=ctx)])["r1"] == expected
    finally:
        prefill.close()


def test_stale_forged_and_unreachable_params_are_refused(factory):
    prefill = Prefill(factory.engine_dir(role="prefill"))
    puller = KVPuller()
    try:
        params = prefill.context("r2", PROMPT, 4)
        puller.pull(params)
        with pytest.raises(ContextParamsError, match=r"stale handoff: handoff 'r2' is not held here"):
            puller.pull(params)
        forged = ContextPhaseParams(**{**params.__dict__, "request_id": "r3", "token": "0" * 32})
        with pytest.raises(ContextParamsError, match="rejected the token"):
            KVPuller().pull(forged)
        gone = ContextPhaseParams(**{**params.__dict__, "agent": "127.0.0.1:1"})
        with pytest.raises(ContextParamsError, match=r"cannot reach transfer agent 127.0.0.1:1"):
            KVPuller().pull(gone)
        with pytest.raises(ContextParamsError, match="not a handoff blob"):
            ContextPhaseParams.from_bytes(b"hello world")
    finally:
        prefill.close()


def test_unacknowledged_handoff_is_reclaimed_after_its_lease(factory):
    prefill = Prefill(factory.engine_dir(role="prefill"), lease_s=0.4)
    try:
        prefill.context("r4", PROMPT, 4)
        assert prefill.loop.stats().blocks_used == 3
        deadline = time.monotonic() + 5
        while prefill.loop.stats().blocks_used and time.monotonic() < deadline:
            time.sleep(0.05)
        assert prefill.loop.stats().blocks_used == 0 and prefill.agent.reclaimed == 1
    finally:
        prefill.close()


def test_an_ack_does_not_hold_up_the_next_message_while_its_blocks_wait_for_the_step_in_flight(factory):
    """A decode instance's claims and acks share one connection. Freeing an acknowledged handoff waits for
    the prefill engine's step in flight (the engine lock, held here for 2 s as a long prompt's chunk holds
    it); the next claim and ack answer at once, and the blocks are freed once the step is done."""
    prefill = Prefill(factory.engine_dir(role="prefill"))
    puller = KVPuller()
    stepping = threading.Event()
    try:
        first, second = prefill.context("r6", PROMPT, 4), prefill.context("r7", PROMPT, 4)
        assert prefill.loop.stats().blocks_used == 6
        step = threading.Thread(target=prefill.loop.call, args=(lambda _engine: (stepping.set(), time.sleep(2.0)),))
        step.start()
        assert stepping.wait(5)
        started = time.monotonic()
        puller.ack(puller.claim(first))
        puller.ack(puller.claim(second))
        answered = time.monotonic() - started
        step.join()
        assert answered < 1.0, f"the second handoff's claim and ack waited {answered:.1f} s behind the first's freeing"
        assert _freed(prefill)
    finally:
        prefill.close()


def _run(engine: LLMEngine, req_id: str) -> list[int]:
    """Steps `engine` until `req_id` finishes; its new tokens."""
    tokens = []
    while True:
        for o in engine.step():
            if o.req_id == req_id:
                tokens += o.tokens
                if o.finished:
                    return tokens


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("decode_tp_pp", [(1, 1), (2, 2)])
def test_direct_import_into_reserved_blocks_continues_exactly_as_aggregated(factory, transport, decode_tp_pp):
    """claim -> reserve decode blocks -> copy prefill's blocks straight in -> ack -> run."""
    expected = factory.engine().generate([Request("a", PROMPT, 10)])["a"]
    prefill = Prefill(factory.engine_dir(2, 1, role="prefill"), transport)
    puller = KVPuller()
    try:
        params = prefill.context("r5", PROMPT, 10)
        claim = puller.claim(params)
        decode = factory.engine(*decode_tp_pp, role="decode")
        request = Request("r5", PROMPT, 10, "generation_only", context=ContextPhase(params.first_token, claim.kv))
        blocks = decode.begin_import(request)
        assert len(blocks) == 4 and decode.num_in_flight == 1 and not decode.has_work()  # 40 + 10 tokens
        claim.kv.copy_into(decode.kv, decode.layout, blocks)
        assert prefill.loop.stats().blocks_used == 3  # held until the ack
        assert puller.ack(claim) > 0
        assert _freed(prefill)
        assert decode.finish_import("r5", copied=True)
        assert _run(decode, "r5") == expected  # the first token again, then the rest
        assert decode.blocks.num_used == 0
    finally:
        puller.close()
        prefill.close()


def test_import_waits_its_turn_and_an_abort_mid_copy_keeps_the_blocks_until_the_copy_ends(factory):
    prefill = Prefill(factory.engine_dir(role="prefill"))
    puller = KVPuller()
    try:
        params = prefill.context("r6", PROMPT, 4)
        claim = puller.claim(params)
        decode = factory.engine(role="decode")
        ctx = ContextPhase(params.first_token, claim.kv)
        decode.add_request(Request("queued", PROMPT, 4))
        assert decode.begin_import(Request("r6", PROMPT, 4, "generation_only", context=ctx)) is None  # behind "queued"
        decode.abort("queued")
        blocks = decode.begin_import(Request("r6", PROMPT, 4, "generation_only", context=ctx))
        assert decode.abort("r6") and decode.blocks.num_used == len(blocks)  # the copy may still be writing
        claim.kv.copy_into(decode.kv, decode.layout, blocks)
        puller.ack(claim)
        assert decode.finish_import("r6", copied=True) is False
        assert decode.blocks.num_used == 0 and decode.num_in_flight == 0
    finally:
        puller.close()
        prefill.close()


def test_an_ack_after_the_lease_ran_out_is_refused(factory):
    """A copy that outlived the lease may have read reused blocks: the ack says so, the request fails."""
    prefill = Prefill(factory.engine_dir(role="prefill"), lease_s=0.3)
    puller = KVPuller()
    try:
        claim = puller.claim(prefill.context("r7", PROMPT, 4))
        deadline = time.monotonic() + 5
        while prefill.agent.num_held and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(ContextParamsError, match=r"stale handoff: handoff 'r7' is not held here"):
            puller.ack(claim)
    finally:
        puller.close()
        prefill.close()


def test_an_ack_is_answered_while_the_prefill_engine_is_busy_with_a_step(factory):
    """Freeing the blocks waits for the step in flight; the decode's request does not."""
    prefill = Prefill(factory.engine_dir(role="prefill"))
    puller = KVPuller(timeout_s=1.0)
    try:
        claim = puller.claim(prefill.context("r8", PROMPT, 4))
        claim.contiguous()
        used = prefill.loop.stats().blocks_used
        step = threading.Event()

        def long_step():
            with prefill.loop._lock:  # what a step of a long prompt holds
                step.set()
                time.sleep(2.0)

        threading.Thread(target=long_step).start()
        step.wait(5)
        started = time.monotonic()
        puller.ack(claim)
        assert time.monotonic() - started < 1.0 and prefill.agent.num_held == 0
        assert used and _freed(prefill)  # once the step ended
    finally:
        puller.close()
        prefill.close()
