"""One engine instance: requests in, tokens out, with in-flight batching over a paged KV cache.

Request types follow TensorRT-LLM:
- `context_and_generation`: prefill the prompt, then decode until a stop condition.
- `context_only`: prefill, sample the first token, then keep the prompt's KV blocks (status HELD)
  until `release` (the transfer agent calls it once decode has pulled them). When that first token
  already ends the request (end_id, or max_new_tokens=1) nothing is kept.
- `generation_only`: import a prompt's KV (from any TP/PP sharding) plus the first token that the
  context phase already produced, and continue decoding; that first token is not emitted again.
  The KV is copied in at admission, or, for a direct handoff, by the caller between `begin_import`
  (which reserves the blocks when the request could be admitted right away) and `finish_import`.

Scheduling is TensorRT-LLM's `guaranteed_no_evict`: a request is admitted only when blocks for its
whole lifetime (prompt + max new tokens) can be reserved, so a running sequence is never preempted.
Every `step` runs one forward over the newly admitted prompts and one token of every running sequence.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np

from disagg.engine.config import EngineConfig
from disagg.engine.kv_cache import BlockManager, KVShape, KVStorage, blocks_for
from disagg.engine.kv_wire import KVLayout, SequenceKV
from disagg.engine.llama import LlamaModel, StepInput
from disagg.engine.paged_kv import PagedKV
from disagg.engine.sampling import SamplingParams, sample
from disagg.engine.weights import read_rank
from disagg.triton.contract import REQUEST_TYPES



class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the limit."""


@dataclass(frozen=True)
class ContextPhase:
    """What a generation-only request continues from: the context phase's first token and KV."""

    first_token: int
    kv: SequenceKV | PagedKV


@dataclass(frozen=True)
class Request:
    req_id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    request_type: str = "context_and_generation"
    sampling: SamplingParams = SamplingParams()
    end_id: int | None = None
    context: ContextPhase | None = None


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"  # context-only and finished: KV kept for the handoff
    IMPORTING = "importing"  # generation-only with blocks reserved: the caller is copying its KV in
    ABORTED = "aborted"  # aborted while importing: its blocks are freed when the copy is over


@dataclass
class Sequence:
    request: Request
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache
    num_generated: int = 0
    status: Status = Status.WAITING
    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    @property
    def req_id(self) -> str:
        return self.request.req_id


@dataclass(frozen=True)
class StepOutput:
    """One request's result of a step: a new token (None when it stopped without one) and whether it is done."""

    req_id: str
    token: int | None
    finished: bool
    finish_reason: str | None = None  # "length" | "end_id" | "context_done" | "error"
    error: str | None = None


class LLMEngine:
    def __init__(self, engine_dir: str | Path, kv_buffer: Callable[[int], object] | None = None):
        """`kv_buffer(nbytes)` supplies the KV pool's memory (e.g. shared memory a decode engine reads)."""
        self.config = EngineConfig.load(engine_dir)
        cfg, m, b = self.config.model, self.config.mapping, self.config.build
        stages = m.stage_layers(cfg.num_hidden_layers)
        shapes = [
            KVShape(len(stages[r // m.tp_size]), b.kv_cache_blocks, b.tokens_per_block, cfg.num_key_value_heads // m.tp_size, cfg.head_dim)
            for r in range(m.world_size)
        ]
        self.kv = KVStorage(shapes, kv_buffer(sum(s.nbytes for s in shapes)) if kv_buffer else None)
        self.blocks = BlockManager(b.kv_cache_blocks, b.tokens_per_block)
        self.model = LlamaModel(self.config, [read_rank(engine_dir, r) for r in range(m.world_size)], self.kv)
        self.layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, b.tokens_per_block, m.tp_size, m.pp_size)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.importing: dict[str, Sequence] = {}

    # -- admission -------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raises RequestError naming the field and limit; accepts exactly what `step` can run."""
        b, vocab = self.config.build, self.config.model.vocab_size
        n = len(req.prompt_ids)
        if req.request_type not in REQUEST_TYPES:
            raise RequestError(f"request_type: {req.request_type!r} is not one of {', '.join(REQUEST_TYPES)}")
        if n == 0:
            raise RequestError("input_ids: empty prompt")
        if n > b.max_input_len:
            raise RequestError(f"input_ids: prompt is {n} tokens, over the limit max_input_len={b.max_input_len}")
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if req.max_new_tokens < 1:
            raise RequestError(f"request_output_len: {req.max_new_tokens} must be >= 1")
        if n + req.max_new_tokens > b.max_seq_len:
            raise RequestError(
                f"request_output_len: prompt {n} + {req.max_new_tokens} new tokens is over the limit max_seq_len={b.max_seq_len}"
            )
        if req.end_id is not None and not 0 <= req.end_id < vocab:
            raise RequestError(f"end_id: {req.end_id} outside the vocabulary [0, {vocab})")
        try:
            req.sampling.validate(vocab)
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if req.request_type == "generation_only":
            if req.context is None:
                raise RequestError("context_phase_params: required for a generation_only request")
            if req.context.kv.num_tokens != n:
                raise RequestError(f"context_phase_params: KV holds {req.context.kv.num_tokens} tokens, the prompt has {n}")
            req.context.kv.layout.check_compatible(self.layout)
        elif n > b.max_num_tokens:
            raise RequestError(f"input_ids: prompt is {n} tokens, over this engine's max_num_tokens={b.max_num_tokens}")
        if blocks_for(self._reserve(req), b.tokens_per_block) > self.blocks.num_blocks:
            raise RequestError(f"request needs more KV blocks than this engine has ({self.blocks.num_blocks})")
        if self.find(req.req_id) is not None:
            raise RequestError(f"request id {req.req_id!r} is already in flight")

    @staticmethod
    def _reserve(req: Request) -> int:
        if req.request_type == "context_only":
            return len(req.prompt_ids)
        return len(req.prompt_ids) + req.max_new_tokens

    def add_request(self, req: Request) -> None:
        self.validate(req)
        self.waiting.append(Sequence(req, list(req.prompt_ids)))

    def begin_import(self, req: Request) -> list[int] | None:
        """Reserves the blocks of a generation_only request that could be admitted right now (nothing
        waiting ahead of it, room in the batch, free blocks), so the caller can copy its KV straight in
        outside the step; None when it would have to wait (then `add_request` it)."""
        self.validate(req)
        if req.request_type != "generation_only":
            raise RequestError(f"request_type: {req.request_type!r} cannot be imported")
        b = self.config.build
        if self.waiting or self.num_in_batch >= b.max_batch_size or not self.blocks.can_allocate(self._reserve(req)):
            return None
        seq = Sequence(req, list(req.prompt_ids), status=Status.IMPORTING)
        seq.block_table = self.blocks.allocate(req.req_id, self._reserve(req))
        seq.first_scheduled_ns = time.time_ns()
        self.importing[req.req_id] = seq
        return seq.block_table

    def finish_import(self, req_id: str, copied: bool) -> bool:
        """Ends a `begin_import`: the sequence runs from the next step, or (aborted meanwhile, or the copy
        failed) its blocks are freed. True when it runs."""
        seq = self.importing.pop(req_id)
        if seq.status is Status.ABORTED or not copied:
            self.blocks.free(seq.block_table)
            return False
        self._start(seq)
        return True

    def find(self, req_id: str) -> Sequence | None:
        seq = self.running.get(req_id) or self.held.get(req_id) or self.importing.get(req_id)
        return seq or next((s for s in self.waiting if s.req_id == req_id), None)

    # -- lifecycle -------------------------------------------------------------------------------
    def abort(self, req_id: str) -> bool:
        """Drops a request wherever it is and frees its blocks; False if it is unknown (already done).
        A sequence being imported keeps its blocks until `finish_import`: the copy may still be writing."""
        importing = self.importing.get(req_id)
        if importing is not None and importing.status is Status.IMPORTING:
            importing.status = Status.ABORTED
            return True
        for queue in (self.running, self.held):
            seq = queue.pop(req_id, None)
            if seq is not None:
                self.blocks.free(seq.block_table)
                return True
        for seq in self.waiting:
            if seq.req_id == req_id:
                self.waiting.remove(seq)
                return True
        return False

    def release(self, req_id: str) -> bool:
        """Frees a context-only sequence's KV once the handoff is done (or its lease expired)."""
        seq = self.held.pop(req_id, None)
        if seq is None:
            return False
        self.blocks.free(seq.block_table)
        return True

    def export_kv(self, req_id: str) -> SequenceKV:
        """The prompt KV of a held context-only sequence, in this engine's sharding."""
        seq = self.held[req_id]
        n = seq.num_cached
        shards = tuple(self.kv.gather(r, seq.block_table, n) for r in range(self.config.mapping.world_size))
        return SequenceKV(self.layout, n, shards)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_in_batch(self) -> int:
        """Sequences that hold a batch slot: running, or having their KV copied in."""
        return len(self.running) + len(self.importing)

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.importing) + len(self.running)

    # -- the step --------------------------------------------------------------------------------
    def _admit(self) -> list[Sequence]:
        """Moves waiting requests in arrival order into the batch; returns those needing a prefill."""
        b = self.config.build
        budget = b.max_num_tokens - len(self.running)
        prefills: list[Sequence] = []
        while self.waiting and self.num_in_batch + len(prefills) < b.max_batch_size:
            seq = self.waiting[0]
            req = seq.request
            gen_only = req.request_type == "generation_only"
            if not gen_only and len(req.prompt_ids) > budget:
                break
            if not self.blocks.can_allocate(self._reserve(req)):
                break
            self.waiting.popleft()
            seq.block_table = self.blocks.allocate(req.req_id, self._reserve(req))
            seq.first_scheduled_ns = time.time_ns()
            if gen_only:
                self._import(seq)
            else:
                budget -= len(req.prompt_ids)
                prefills.append(seq)
        return prefills

    def _import(self, seq: Sequence) -> None:
        seq.request.context.kv.copy_into(self.kv, self.layout, seq.block_table)
        self._start(seq)

    def _start(self, seq: Sequence) -> None:
        """An imported sequence joins the batch after its first token, which the context phase sampled."""
        ctx = seq.request.context
        seq.num_cached = ctx.kv.num_tokens
        seq.tokens.append(ctx.first_token)
        seq.num_generated = 1
        seq.status = Status.RUNNING
        self.running[seq.req_id] = seq

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        prefills = self._admit()
        # Imported sequences that may produce nothing more finish without a forward pass.
        for seq in [s for s in self.running.values() if s.num_generated >= s.request.max_new_tokens]:
            outputs.append(self._finish(seq, None, "length"))
        decodes = list(self.running.values())
        batch = [StepInput(np.asarray(s.tokens, dtype=np.int64), 0, s.block_table) for s in prefills]
        batch += [StepInput(np.asarray(s.tokens[-1:], dtype=np.int64), s.num_cached, s.block_table) for s in decodes]
        if not batch:
            return outputs
        logits = self.model.forward(batch)
        now = time.time_ns()
        for seq, row in zip(prefills + decodes, logits):
            seq.num_cached = len(seq.tokens)
            token = sample(row, seq.request.sampling, len(seq.tokens))
            outputs.append(self._advance(seq, token, now))
        return outputs

    def _advance(self, seq: Sequence, token: int, now: int) -> StepOutput:
        req = seq.request
        if seq.status is Status.WAITING:
            seq.status = Status.RUNNING
            self.running[seq.req_id] = seq
        if req.end_id is not None and token == req.end_id:
            return self._finish(seq, None, "end_id")
        seq.tokens.append(token)
        seq.num_generated += 1
        seq.first_token_ns = seq.first_token_ns or now
        seq.last_token_ns = now
        if req.request_type == "context_only" and seq.num_generated < req.max_new_tokens:
            del self.running[seq.req_id]
            seq.status = Status.HELD
            self.held[seq.req_id] = seq
            return StepOutput(seq.req_id, token, True, "context_done")
        if seq.num_generated >= req.max_new_tokens:
            return self._finish(seq, token, "length")
        return StepOutput(seq.req_id, token, False)

    def _finish(self, seq: Sequence, token: int | None, reason: str) -> StepOutput:
        self.running.pop(seq.req_id, None)
        self.blocks.free(seq.block_table)
        return StepOutput(seq.req_id, token, True, reason)

    # -- convenience -----------------------------------------------------------------------------
    def generate(self, requests: list[Request]) -> dict[str, list[int]]:
        """Runs requests to completion (all admitted together, batched in flight); new tokens per request."""
        out: dict[str, list[int]] = {r.req_id: [] for r in requests}
        for r in requests:
            self.add_request(r)
        pending = set(out)
        while pending:
            outputs = self.step()
            if not outputs and not self.running:
                raise RuntimeError(f"stalled: {len(pending)} requests wait for KV blocks held by {len(self.held)} handoffs")
            for o in outputs:
                if o.token is not None:
                    out[o.req_id].append(o.token)
                if o.finished:
                    pending.discard(o.req_id)
        return out
