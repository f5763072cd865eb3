"""One engine instance: requests in, tokens out, with in-flight batching over a paged KV cache.

Request types follow TensorRT-LLM's executor:
- `context_and_generation`: prefill the prompt, then decode until a stop condition.
- `context_only`: prefill, sample the first token, then keep the prompt's KV blocks (status HELD)
  until `release` (the transfer agent calls it once decode has pulled them, or when the lease runs out)
  or `abort`. When that first token already ends the request (end_id, or max_new_tokens=1) it finishes
  like any request and nothing is kept: the decoder marks it complete (trtGptModelInflightBatching.cpp
  updateRequests -> kGENERATION_COMPLETE) before forwardSync hands context-only requests whose context
  finished to the cache transceiver, so it never gets context phase params (and the tensorrtllm backend
  answers it with an error, see disagg.triton.engine_model).
- `generation_only`: import a prompt's KV (from any TP/PP sharding) plus the first token that the
  context phase produced, and continue decoding. That first token is returned again: TensorRT-LLM
  re-adds it (trtGptModelInflightBatching.cpp prepareDistGenBufferAndDecoder: `addNewToken(firstGenTokens)`)
  and counts the tokens sent from the prompt length, so its first result carries [first, second].
  The KV is copied in at admission, or, for a direct handoff, by the caller between `begin_import`
  (which reserves the blocks when the request could be admitted right away) and `finish_import`.

A request's `sampling.min_tokens` keeps end_id from being drawn while fewer new tokens than that exist
(`sampling.mask_end_id`, TensorRT-LLM's min-length penalty); a generation-only request counts the context
phase's token among them, so disaggregated and aggregated give the same tokens. end_id -1 (`NO_END_ID`)
means no token ends the request, only its length.

Every result carries the tokens not returned before, as llmRequest.cpp createResult returns those past
`getMaxSentTokenLen()`, which starts at the prompt length (llmRequest.h `mMaxSentTokenLen(mPromptLen)`).

Scheduling is TensorRT-LLM's `guaranteed_no_evict`: a request is admitted only when blocks for its
whole lifetime (prompt + max new tokens) can be reserved, so a running sequence is never preempted.
Every `step` runs one forward over one token of every generating sequence plus the prompts that fit in
the rest of `max_num_tokens`: whole prompts, or, with chunked context, chunks of them (`_context_chunks`).
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
from disagg.engine.kv_cache import BlockManager, KVShape, KVStorage, block_hashes, blocks_for
from disagg.engine.kv_wire import KVLayout, SequenceKV
from disagg.engine.kv_store import KVStore
from disagg.engine.llama import LlamaModel, StepInput
from disagg.engine.no_compute import NoComputeModel
from disagg.engine.paged_kv import PagedKV
from disagg.engine.sampling import NO_END_ID, SamplingParams, mask_end_id, sample
from disagg.engine.weights import read_rank

# What the tensorrtllm backend answers for a prompt over the engine's maximum input length, any request
# type: LlmRequest::validate (llmRequest.cpp) throws it, executorImpl.cpp fetchNewRequests prefixes it.
# (Upstream's exception text then adds the throwing source line and a stack trace.)
PROMPT_TOO_LONG = (
    "Encountered an error when fetching new request: Prompt length ({}) exceeds maximum input length ({}). "
    "Set log level to info and check TRTGptModel logs for how maximum input length is set"
)


# TensorRT-LLM's request types, as the tensorrtllm backend reads the `request_type` request parameter.
REQUEST_TYPES = ("context_and_generation", "context_only", "generation_only")


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
    CONTEXT = "context"  # in the batch, its prompt being prefilled (over several steps with chunked context)
    RUNNING = "running"  # generating
    HELD = "held"  # context-only and finished: KV kept for the handoff
    IMPORTING = "importing"  # generation-only with blocks reserved: the caller is copying its KV in
    ABORTED = "aborted"  # aborted while importing: its blocks are freed when the copy is over


@dataclass
class Sequence:
    request: Request
    tokens: list[int]
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose KV is in the cache
    hashes: list[int] = field(default_factory=list)  # of its full blocks registered for reuse, in order
    reused_blocks: int = 0  # of its prompt, found cached (in this instance or the node's store)
    num_generated: int = 0
    num_sent: int = field(init=False)  # tokens returned so far, counted from the prompt's start
    status: Status = Status.WAITING
    arrival_ns: int = field(default_factory=time.time_ns)
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    def __post_init__(self) -> None:
        self.num_sent = len(self.request.prompt_ids)

    @property
    def req_id(self) -> str:
        return self.request.req_id


@dataclass(frozen=True)
class HeldKV:
    """A finished context phase's KV, kept for its handoff: its blocks and the tokens they hold."""

    block_ids: tuple[int, ...]
    tokens: int


@dataclass(frozen=True)
class StepOutput:
    """One request's result of a step: the tokens not returned before (none when it stopped without a new
    one) and whether it is done."""

    req_id: str
    tokens: tuple[int, ...]
    finished: bool
    finish_reason: str | None = None  # "length" | "end_id" | "context_done" | "error"
    error: str | None = None
    # when it finished: (blocks allocated, of those reused from a cache); bookkeeping, not part of the result
    kv_blocks: tuple[int, int] | None = field(default=None, compare=False)
    # "context_done": where its prompt's KV is held, as TensorRT-LLM's context-phase result carries its
    # contextPhaseParams, so a handoff is described without waiting for the engine's next step
    held: HeldKV | None = field(default=None, compare=False)

    @property
    def token(self) -> int | None:
        """The newest token returned, if any (for a context-only result: its first token)."""
        return self.tokens[-1] if self.tokens else None


class LLMEngine:
    def __init__(self, engine_dir: str | Path, kv_buffer: Callable[[int], object] | None = None, skip_compute: bool = False,
                 kv_store: KVStore | None = None):
        """`kv_buffer(nbytes)` supplies the KV pool's memory (e.g. shared memory a decode engine reads);
        `skip_compute` swaps the decoder for one that costs nothing (disagg.engine.no_compute); `kv_store`
        (with prefix reuse) is the node's store of prefix blocks this instance publishes to and imports from."""
        self.config = EngineConfig.load(engine_dir)
        cfg, m, b = self.config.model, self.config.mapping, self.config.build
        stages = m.stage_layers(cfg.num_hidden_layers)
        shapes = [
            KVShape(len(stages[r // m.tp_size]), b.kv_cache_blocks, b.tokens_per_block, cfg.num_key_value_heads // m.tp_size, cfg.head_dim)
            for r in range(m.world_size)
        ]
        self.kv = KVStorage(shapes, kv_buffer(sum(s.nbytes for s in shapes)) if kv_buffer else None)
        self.blocks = BlockManager(b.kv_cache_blocks, b.tokens_per_block, reuse=b.enable_kv_cache_reuse)
        self.reused_blocks = 0  # prompt blocks found cached, over all requests (kv_cache_reused_blocks)
        self.prompt_blocks = 0  # prompt blocks looked up: reused / prompt_blocks is the hit rate
        self.store = kv_store if b.enable_kv_cache_reuse else None
        self.store_hits = 0  # prompt blocks imported from the store (not in this instance's own cache)
        if skip_compute:
            self.model = NoComputeModel(cfg.vocab_size)
        else:
            self.model = LlamaModel(self.config, [read_rank(engine_dir, r) for r in range(m.world_size)], self.kv)
        self.layout = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, b.tokens_per_block, m.tp_size, m.pp_size)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}
        self.importing: dict[str, Sequence] = {}

    # -- admission -------------------------------------------------------------------------------
    def validate(self, req: Request) -> None:
        """Raises RequestError naming the field and limit (a prompt over the engine's maximum input length in
        TensorRT-LLM's words, for every request type); accepts exactly what `step` can run. Reads the request
        and the engine's fixed limits only, so it needs no lock; whether its id is in flight is `enqueue`'s."""
        b, vocab = self.config.build, self.config.model.vocab_size
        n = len(req.prompt_ids)
        if req.request_type not in REQUEST_TYPES:
            raise RequestError(f"request_type: {req.request_type!r} is not one of {', '.join(REQUEST_TYPES)}")
        if n == 0:
            raise RequestError("input_ids: empty prompt")
        if n > b.engine_max_input_len:
            raise RequestError(PROMPT_TOO_LONG.format(n, b.engine_max_input_len))
        bad = [t for t in req.prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"input_ids: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if req.max_new_tokens < 1:
            raise RequestError(f"request_output_len: {req.max_new_tokens} must be >= 1")
        if n + req.max_new_tokens > b.max_seq_len:
            raise RequestError(
                f"request_output_len: prompt {n} + {req.max_new_tokens} new tokens is over the limit max_seq_len={b.max_seq_len}"
            )
        if req.end_id is not None and req.end_id != NO_END_ID and not 0 <= req.end_id < vocab:
            raise RequestError(f"end_id: {req.end_id} outside the vocabulary [0, {vocab}) and not {NO_END_ID}")
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
        if blocks_for(self._reserve(req), b.tokens_per_block) > self.blocks.num_blocks:
            raise RequestError(f"request needs more KV blocks than this engine has ({self.blocks.num_blocks})")

    @staticmethod
    def _reserve(req: Request) -> int:
        if req.request_type == "context_only":
            return len(req.prompt_ids)
        return len(req.prompt_ids) + req.max_new_tokens

    def add_request(self, req: Request) -> None:
        self.validate(req)
        self.enqueue(req)

    def enqueue(self, req: Request) -> None:
        """Queues a validated request; raises RequestError when its id is already in flight."""
        self._check_new_id(req.req_id)
        self.waiting.append(Sequence(req, list(req.prompt_ids)))

    def _check_new_id(self, req_id: str) -> None:
        if self.find(req_id) is not None:
            raise RequestError(f"request id {req_id!r} is already in flight")

    def begin_import(self, req: Request) -> list[int] | None:
        """Reserves the blocks of a generation_only request that could be admitted right now (nothing
        waiting ahead of it, room in the batch, free blocks), so the caller can copy its KV straight in
        outside the step; None when it would have to wait (then `add_request` it)."""
        self.validate(req)
        self._check_new_id(req.req_id)
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
    def num_in_context(self) -> int:
        return sum(seq.status is Status.CONTEXT for seq in self.running.values())

    @property
    def num_in_batch(self) -> int:
        """Sequences that hold a batch slot: running, or having their KV copied in."""
        return len(self.running) + len(self.importing)

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.importing) + len(self.running)

    # -- the step --------------------------------------------------------------------------------
    def _admit(self) -> None:
        """Moves waiting requests, in arrival order, into the batch while it has a slot and the pool has blocks
        for their whole lifetime. Without chunked context a prompt must also fit in this step's token budget
        whole (`max_num_tokens`, one token per generating sequence taken first); with it, `_context_chunks`
        spreads a prompt over as many steps as it needs."""
        b = self.config.build
        budget = b.max_num_tokens - len(self.running)
        while self.waiting and self.num_in_batch < b.max_batch_size:
            seq = self.waiting[0]
            req = seq.request
            gen_only = req.request_type == "generation_only"
            # The longest cached prefix of whole blocks, never the last token: its logits are needed
            # (TensorRT-LLM kvCacheManager.cpp BlockManager::addSequence chops inputLength - 1 tokens).
            hashes = [] if gen_only or not self.blocks.reuse else block_hashes(req.prompt_ids[:-1], b.tokens_per_block)
            reuse = self.blocks.match(hashes)
            if not self.blocks.can_allocate(self._reserve(req), reuse):
                break
            stored = self._stored_prefix(req.prompt_ids, hashes) if len(reuse) < len(hashes) else (0, 0, [])
            tokens = 1 if gen_only else len(req.prompt_ids) - max(len(reuse), stored[1]) * b.tokens_per_block
            if tokens > budget and not b.enable_chunked_context:
                break
            self.waiting.popleft()
            seq.block_table = self.blocks.allocate(req.req_id, self._reserve(req), reuse)
            seq.first_scheduled_ns = time.time_ns()
            budget -= tokens
            if gen_only:
                self._import(seq)
            else:
                found = max(len(reuse), self._import_stored(seq.block_table, hashes, len(reuse), *stored))
                seq.num_cached, seq.hashes, seq.reused_blocks = found * b.tokens_per_block, hashes[:found], found
                self.reused_blocks += found
                self.prompt_blocks += len(hashes)
                seq.status = Status.CONTEXT
                self.running[seq.req_id] = seq

    def _stored_prefix(self, prompt: tuple[int, ...], hashes: list[int]) -> tuple[int, int, list[int]]:
        """(publisher block size, this engine's blocks it covers, the prompt's hashes in that size): the
        longest prefix of the prompt's blocks (`hashes`, in this engine's size) the node's store holds, in
        whichever block size it was published."""
        if self.store is None:
            return 0, 0, []
        tpb, best = self.config.build.tokens_per_block, (0, 0, [])
        for size in self.store.sizes():
            published = hashes if size == tpb else block_hashes(prompt[:-1], size)
            run = next((i for i, h in enumerate(published) if not self.store.contains(size, h)), len(published))
            covered = min(run * size // tpb, len(hashes))
            if covered > best[1]:
                best = (size, covered, published)
        return best

    def _import_stored(self, block_table: list[int], hashes: list[int], local: int, size: int, covered: int, published: list[int]) -> int:
        """Copies the store's KV for this engine's blocks `local`..`covered` (after those its own cache had)
        into the sequence, token-major as a handoff, whatever the publisher's sharding and block size
        (`published`: the prompt's hashes in it); how many blocks the sequence then has (a block evicted
        meanwhile ends the run: the rest is computed)."""
        tpb = self.config.build.tokens_per_block
        if covered <= local:
            return local
        first, last = local * tpb // size, -(-covered * tpb // size)  # the publisher's blocks that hold them
        parts = []
        for i in range(first, last):
            kv = self.store.get(size, published[i])
            if kv is None:
                break
            parts.append(kv.full())
        covered = min(covered, (first + len(parts)) * size // tpb)
        if covered <= local:
            return local
        start = local * tpb - first * size
        tokens = np.concatenate(parts, axis=2)[:, :, start : start + (covered - local) * tpb]
        cfg = self.config.model
        whole = KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, size, 1, 1)
        SequenceKV(whole, tokens.shape[2], (tokens,)).copy_into(self.kv, self.layout, block_table[local:covered])
        for i in range(local, covered):
            self.blocks.register(block_table[i], hashes[i])
        self.store_hits += covered - local
        return covered

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Offers the sequence's blocks that its computed KV now fills for reuse (prompt and generated
        tokens alike, so the next turn of a conversation finds them)."""
        if not self.blocks.reuse:
            return
        tpb = self.config.build.tokens_per_block
        while (len(seq.hashes) + 1) * tpb <= seq.num_cached:
            i = len(seq.hashes)
            seq.hashes += block_hashes(seq.tokens[i * tpb : (i + 1) * tpb], tpb, seq.hashes[-1] if seq.hashes else 0)
            self.blocks.register(seq.block_table[i], seq.hashes[-1])
            if self.store is not None and not self.store.contains(tpb, seq.hashes[-1]):
                ranks = range(self.config.mapping.world_size)
                block = SequenceKV(self.layout, tpb, tuple(self.kv.gather(r, [seq.block_table[i]], tpb) for r in ranks))
                self.store.put(tpb, seq.hashes[-1], block)

    def _context_chunks(self, budget: int) -> list[tuple[Sequence, int]]:
        """(sequence, end): the part of each prompt in the batch that this step prefills, given the `budget`
        of tokens the generating sequences leave. TensorRT-LLM's first-come-first-served context chunking
        (microBatchScheduler.cpp `setCtxRequestsChunkSize<kFIRST_COME_FIRST_SERVED>`, chunk unit
        tokens_per_block as trtGptModelInflightBatching.cpp sets it): in arrival order, the rest of the
        prompt when it fits, else what fits rounded down to a multiple of tokens_per_block (maybe nothing:
        that prompt waits a step). Without chunked context `_admit` let in only prompts that fit whole."""
        tpb = self.config.build.tokens_per_block
        chunks = []
        for seq in self.running.values():
            if seq.status is not Status.CONTEXT:
                continue
            rest = len(seq.tokens) - seq.num_cached
            size = rest if rest <= budget else budget // tpb * tpb
            if size:
                chunks.append((seq, seq.num_cached + size))
                budget -= size
        return chunks

    def _import(self, seq: Sequence) -> None:
        seq.request.context.kv.copy_into(self.kv, self.layout, seq.block_table)
        self._start(seq)

    def _start(self, seq: Sequence) -> None:
        """An imported sequence joins the batch after its first token, which the context phase sampled; it is
        not returned yet (`num_sent` stays at the prompt length), so its first result returns it again."""
        ctx = seq.request.context
        seq.num_cached = ctx.kv.num_tokens
        self._register_full_blocks(seq)
        seq.tokens.append(ctx.first_token)
        seq.num_generated = 1
        seq.status = Status.RUNNING
        self.running[seq.req_id] = seq

    def step(self) -> list[StepOutput]:
        outputs: list[StepOutput] = []
        self._admit()
        # Imported sequences that may produce nothing more finish without a forward pass.
        for seq in [s for s in self.running.values() if s.num_generated >= s.request.max_new_tokens]:
            outputs.append(self._finish(seq, "length"))
        decodes = [s for s in self.running.values() if s.status is Status.RUNNING]
        work = self._context_chunks(self.config.build.max_num_tokens - len(decodes)) + [(s, len(s.tokens)) for s in decodes]
        if not work:
            return outputs
        batch = [StepInput(np.asarray(s.tokens[s.num_cached : end], dtype=np.int64), s.num_cached, s.block_table) for s, end in work]
        logits = self.model.forward(batch)
        now = time.time_ns()
        for (seq, end), row in zip(work, logits):
            seq.num_cached = end
            self._register_full_blocks(seq)
            if end == len(seq.tokens):  # a decode, or a prompt's last chunk: only these logits are sampled
                req = seq.request
                row = mask_end_id(row, req.end_id, seq.num_generated, req.sampling.min_tokens)
                outputs.append(self._advance(seq, sample(row, req.sampling, end), now))
        return outputs

    def _advance(self, seq: Sequence, token: int, now: int) -> StepOutput:
        req = seq.request
        seq.status = Status.RUNNING
        if req.end_id is not None and token == req.end_id:
            # end_id is not appended (as the decoder does not count it in the sequence length).
            return self._finish(seq, "end_id")
        seq.tokens.append(token)
        seq.num_generated += 1
        seq.first_token_ns = seq.first_token_ns or now
        seq.last_token_ns = now
        if req.request_type == "context_only" and seq.num_generated < req.max_new_tokens:
            return self._hold(seq)
        if seq.num_generated >= req.max_new_tokens:
            return self._finish(seq, "length")
        return self._result(seq, False)

    def _hold(self, seq: Sequence) -> StepOutput:
        """A context-only sequence is done: its prompt's KV is kept for the handoff."""
        del self.running[seq.req_id]
        seq.status = Status.HELD
        self.held[seq.req_id] = seq
        return self._result(seq, True, "context_done")

    def _finish(self, seq: Sequence, reason: str) -> StepOutput:
        self.running.pop(seq.req_id, None)
        self.blocks.free(seq.block_table)
        return self._result(seq, True, reason)

    @staticmethod
    def _result(seq: Sequence, finished: bool, reason: str | None = None) -> StepOutput:
        """The tokens not returned before, and from now on returned; a held sequence's with where its KV is."""
        tokens = tuple(seq.tokens[seq.num_sent :])
        seq.num_sent = len(seq.tokens)
        held = HeldKV(tuple(seq.block_table), seq.num_cached) if seq.status is Status.HELD else None
        return StepOutput(seq.req_id, tokens, finished, reason, kv_blocks=(len(seq.block_table), seq.reused_blocks) if finished else None,
                          held=held)

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
                out[o.req_id] += o.tokens
                if o.finished:
                    pending.discard(o.req_id)
        return out
