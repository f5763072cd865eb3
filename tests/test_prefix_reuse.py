"""Prefix reuse (`enable_kv_cache_reuse`) in the reference engine: same tokens as without it, blocks
reused where the prefix is cached, never freed or overwritten while referenced, evicted least recently
used first."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_helpers import LIMITS, EngineFactory

from disagg.engine.engine import Request
from disagg.engine.kv_cache import BlockManager, block_hashes
from disagg.engine.sampling import NO_END_ID, SamplingParams

REUSE = dataclasses.replace(LIMITS, enable_kv_cache_reuse=True)
TPB = LIMITS.tokens_per_block  # 16


@pytest.fixture(scope="module")
def factory(tmp_path_factory) -> EngineFactory:
    return EngineFactory(tmp_path_factory.mktemp("engines"))


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(int(t) for t in np.random.default_rng(seed).integers(2, 512, size=n))


def run(engine, req_id, prompt, max_new, sampling=SamplingParams()) -> list[int]:
    return engine.generate([Request(req_id, prompt, max_new, sampling=sampling, end_id=NO_END_ID)])[req_id]


# -- the block manager ---------------------------------------------------------------------------------

def test_a_freed_registered_block_stays_cached_until_evicted_least_recently_freed_first():
    bm = BlockManager(4, TPB, reuse=True)
    a, b = bm.allocate("a", 2 * TPB), bm.allocate("b", 2 * TPB)
    ha, hb = block_hashes(tokens(2 * TPB, 1), TPB), block_hashes(tokens(2 * TPB, 2), TPB)
    for block, h in [*zip(a, ha), *zip(b, hb)]:
        bm.register(block, h)
    bm.free(a)
    bm.free(b)
    assert (bm.num_used, bm.num_free, bm.num_cached) == (0, 4, 4)  # cached blocks count as free
    assert bm.match(ha) == a and bm.match(hb[:1]) == b[:1]
    c = bm.allocate("c", TPB)  # no free block left: evicts a's first block, the least recently freed
    assert c == a[:1] and bm.match(ha) == [] and bm.match(hb) == b
    assert bm.num_cached == 3


def test_a_shared_block_is_freed_only_by_its_last_holder():
    bm = BlockManager(3, TPB, reuse=True)
    first = bm.allocate("a", TPB)
    h = block_hashes(tokens(TPB, 3), TPB)
    bm.register(first[0], h[0])
    second = bm.allocate("b", 2 * TPB, reuse=bm.match(h))
    assert second[0] == first[0] and bm.refs[first[0]] == 2
    bm.free(first)
    assert bm.num_used == 2 and not bm.can_allocate(2 * TPB)  # b still holds the shared block
    bm.free(second)
    assert bm.num_used == 0
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(second)


def test_reusing_an_evictable_block_takes_it_out_of_the_free_count():
    bm = BlockManager(2, TPB, reuse=True)
    held = bm.allocate("a", TPB)
    h = block_hashes(tokens(TPB, 4), TPB)
    bm.register(held[0], h[0])
    bm.free(held)
    assert bm.can_allocate(2 * TPB, bm.match(h)) and not bm.can_allocate(3 * TPB, bm.match(h))


# -- the engine ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=11)], ids=["greedy", "seeded"])
def test_shared_prefix_multi_turn_and_no_overlap_give_the_tokens_of_no_reuse(factory, sampling):
    plain, reuse = factory.engine(), factory.engine(limits=REUSE)
    system = tokens(3 * TPB + 5, 10)  # 3 whole blocks and a bit
    cases = [(f"s{i}", system + tokens(20 + i, 20 + i)) for i in range(3)] + [("other", tokens(70, 30))]
    for req_id, prompt in cases:
        assert run(reuse, req_id, prompt, 12, sampling) == run(plain, req_id, prompt, 12, sampling), req_id
    assert reuse.reused_blocks == 2 * 3  # s1 and s2 found the system prompt's 3 blocks; "other" nothing
    # A conversation: each turn sends the whole history; its earlier turns' blocks (answers included) are reused.
    history, computed = tokens(40, 40), 0
    for turn in range(4):
        before = reuse.reused_blocks
        answer = run(reuse, f"t{turn}", history, 20, sampling)
        assert answer == run(plain, f"t{turn}", history, 20, sampling), f"turn {turn}"
        # every whole block the previous turn computed KV for (its last answer token's KV never was)
        assert reuse.reused_blocks - before == computed // TPB, f"turn {turn}"
        computed = len(history) + 19
        history = history + tuple(answer) + tokens(8, 50 + turn)
    assert reuse.blocks.num_used == 0 and plain.blocks.num_used == 0


def test_concurrent_requests_share_the_cached_prefix_and_decode_alike(factory):
    plain, reuse = factory.engine(), factory.engine(limits=REUSE)
    system = tokens(4 * TPB, 60)
    run(reuse, "warm", system + tokens(3, 61), 2)  # the system prompt's blocks cached
    batch = [Request(f"c{i}", system + tokens(10 + i, 70 + i), 16, end_id=NO_END_ID) for i in range(6)]
    assert reuse.generate(batch) == plain.generate(batch)
    assert reuse.reused_blocks == 6 * 4
    assert reuse.blocks.num_used == 0


def test_generated_blocks_are_reused_by_the_next_turn(factory):
    reuse = factory.engine(limits=REUSE)
    prompt = tokens(TPB, 80)
    answer = run(reuse, "turn1", prompt, 3 * TPB)
    before = reuse.reused_blocks
    run(reuse, "turn2", prompt + tuple(answer) + tokens(5, 81), 4)
    # turn 1 computed KV for its prompt and all but its last generated token: 3 whole blocks of 4
    assert reuse.reused_blocks - before == 3


def test_aborting_a_partly_cached_prompt_mid_prefill_keeps_the_shared_blocks(factory):
    chunked = dataclasses.replace(REUSE, enable_chunked_context=True, max_num_tokens=2 * TPB)
    engine, plain = factory.engine(limits=chunked), factory.engine()
    system = tokens(2 * TPB, 90)
    run(engine, "warm", system + tokens(4, 91), 2)
    long = system + tokens(6 * TPB, 92)
    engine.add_request(Request("cut", long, 4, end_id=NO_END_ID))
    engine.step()  # 2 blocks reused, the first chunk of the rest prefilled
    seq = engine.running["cut"]
    assert seq.num_cached == 4 * TPB and engine.blocks.refs[seq.block_table[0]] == 1
    assert engine.abort("cut") and engine.blocks.num_used == 0
    # The shared prefix and the chunk it prefilled are still cached and still right.
    before = engine.reused_blocks
    assert run(engine, "again", long, 6) == run(plain, "again", long, 6)
    assert engine.reused_blocks - before == 4


def test_eviction_under_pressure_keeps_outputs_right(factory):
    small = dataclasses.replace(REUSE, kv_cache_blocks=12)
    engine, plain = factory.engine(limits=small), factory.engine()
    prompts = [tokens(3 * TPB + 2, 100 + i) for i in range(6)]  # 4 blocks each, 3 of them cached after
    for i, p in enumerate(prompts):
        assert run(engine, f"a{i}", p, 6) == run(plain, f"a{i}", p, 6)
        assert engine.blocks.num_cached <= small.kv_cache_blocks
    assert engine.reused_blocks == 0
    # The pool holds the most recent prompts' blocks; the earliest were evicted. Newest first: the last
    # prompt is found whole, and each run evicts the oldest of what is left.
    found = []
    for i, p in reversed(list(enumerate(prompts))):
        before = engine.reused_blocks
        assert run(engine, f"b{i}", p, 6) == run(plain, f"b{i}", p, 6)
        found.append(engine.reused_blocks - before)
    assert found[0] == 3 and found[-1] == 0 and engine.blocks.num_used == 0


def test_the_prefix_benchmark_reports_hits_only_where_prompts_share(tmp_path, capsys):
    from disagg.bench.prefix import main

    assert main(["--root", str(tmp_path), "--preset", "tiny", "--prompt-tokens", "128", "--requests", "4", "--no-routing"]) == 0
    rows = {line[:26].strip(): line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("(")}
    # (a): every request after the first finds the 90% prefix: 7 of 7 blocks for 3 of 4 requests
    assert rows["(a) 90% shared prefix"][-1] == "75%"
    assert rows["(b) 8-turn conversations"][-1] != "0%" and rows["(c) nothing shared"][-1] == "0%"


# -- the node's shared store ---------------------------------------------------------------------------

def test_a_prefix_computed_by_one_instance_serves_another_of_another_layout(factory, tmp_path):
    from disagg.engine.engine import LLMEngine
    from disagg.engine.kv_store import KVStore

    store = KVStore(tmp_path, "disagg-kvstore-test-t16-", 1 << 30)
    first = LLMEngine(factory.engine_dir(limits=REUSE), kv_store=store)
    second = LLMEngine(factory.engine_dir(tp=2, pp=2, limits=REUSE), kv_store=store)  # another instance, sharded
    plain = factory.engine()
    system = tokens(5 * TPB, 110)
    prompt = system + tokens(9, 111)
    assert run(first, "a", prompt, 10) == run(plain, "a", prompt, 10)
    assert store.written >= 5 and first.store_hits == 0
    other = system + tokens(7, 112)
    assert run(second, "b", other, 10) == run(plain, "b", other, 10)
    assert second.store_hits == 5 and second.reused_blocks == 5  # its own cache was empty
    assert second.blocks.num_used == 0


def test_the_store_stays_within_its_bytes_and_drops_the_least_recently_used(tmp_path):
    from disagg.engine.kv_store import KVStore
    from disagg.engine.kv_wire import KVLayout, SequenceKV

    layout = KVLayout(2, 2, 4, TPB, 1, 1)
    block = SequenceKV(layout, TPB, (np.ones((2, 2, TPB, 2, 4), dtype=np.float32),))
    size = len(block.to_bytes())
    store = KVStore(tmp_path, "disagg-kvstore-x-", 3 * size)
    for h in range(3):
        store.put(TPB, h, block)
    assert store.get(TPB, 0) is not None  # 0 is now the most recently used
    store.put(TPB, 3, block)  # over capacity: 1, the least recently used, goes
    assert [store.contains(TPB, h) for h in range(4)] == [True, False, True, True]
    assert store.nbytes() <= 3 * size and store.evicted == 1
    assert not list(tmp_path.glob("*tmp*"))


def test_concurrent_writers_leave_whole_blocks(tmp_path):
    import threading

    from disagg.engine.kv_store import KVStore
    from disagg.engine.kv_wire import KVLayout, SequenceKV

    layout = KVLayout(2, 2, 4, TPB, 1, 1)
    blocks = {h: SequenceKV(layout, TPB, (np.full((2, 2, TPB, 2, 4), h, dtype=np.float32),)) for h in range(20)}
    stores = [KVStore(tmp_path, "disagg-kvstore-y-", 1 << 30) for _ in range(4)]

    def write(store):
        for h, block in blocks.items():
            store.put(TPB, h, block)

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for h in blocks:
        got = stores[0].get(TPB, h)
        assert got is not None and float(got.shards[0].mean()) == h
    assert not list(tmp_path.glob("*tmp*"))


def test_blocks_pushed_out_of_memory_go_to_disk_and_come_back_when_read(tmp_path):
    from disagg.engine.kv_store import KVStore
    from disagg.engine.kv_wire import KVLayout, SequenceKV

    layout = KVLayout(2, 2, 4, TPB, 1, 1)
    blocks = {h: SequenceKV(layout, TPB, (np.full((2, 2, TPB, 2, 4), h, dtype=np.float32),)) for h in range(4)}
    size = len(blocks[0].to_bytes())
    disk = KVStore(tmp_path / "disk", "", 10 * size)
    memory = KVStore(tmp_path / "shm", "disagg-kvstore-z-", 2 * size, below=disk)
    for h, block in blocks.items():
        memory.put(TPB, h, block)
    assert len(list((tmp_path / "shm").glob("*.kv"))) == 2 and len(list((tmp_path / "disk").glob("*.kv"))) == 2
    assert all(memory.contains(TPB, h) for h in blocks) and memory.sizes() == {TPB}
    got = memory.get(TPB, 0)  # on disk only: read from there and moved back up, pushing another down
    assert float(got.shards[0].mean()) == 0 and (tmp_path / "shm" / f"disagg-kvstore-z-t{TPB}-{0:016x}.kv").is_file()
    assert memory.nbytes() <= 2 * size and disk.nbytes() <= 10 * size


def test_a_restarted_deployment_finds_the_prefix_on_disk(factory, tmp_path):
    from disagg.engine.engine import LLMEngine
    from disagg.engine.kv_store import KVStore

    plain = factory.engine()
    prompt = tokens(5 * TPB, 120) + tokens(9, 121)
    block_bytes = 4 * 2 * 4 * TPB * 8 * 4 + 4096  # layers x (k, v) x heads x tokens x head_dim x 4 bytes, plus header
    before = KVStore(tmp_path / "shm1", "disagg-kvstore-a-", block_bytes, below=KVStore(tmp_path / "disk", "", 1 << 30))
    assert run(LLMEngine(factory.engine_dir(limits=REUSE), kv_store=before), "a", prompt, 10) == run(plain, "a", prompt, 10)
    # A new deployment: its memory tier starts empty; the disk tier is the same directory.
    after = KVStore(tmp_path / "shm2", "disagg-kvstore-b-", 1 << 30, below=KVStore(tmp_path / "disk", "", 1 << 30))
    engine = LLMEngine(factory.engine_dir(limits=REUSE), kv_store=after)
    assert run(engine, "b", prompt, 10) == run(plain, "b", prompt, 10)
    assert engine.store_hits >= 4  # the blocks the first one pushed down (its newest stayed in its memory)


def test_a_prefix_published_in_one_block_size_serves_an_engine_of_another(factory, tmp_path):
    from disagg.engine.engine import LLMEngine
    from disagg.engine.kv_store import KVStore

    store = KVStore(tmp_path, "disagg-kvstore-s-", 1 << 30)
    publisher = LLMEngine(factory.engine_dir(limits=REUSE), kv_store=store)  # blocks of 16
    big = dataclasses.replace(REUSE, tokens_per_block=32, kv_cache_blocks=200)
    importer = LLMEngine(factory.engine_dir(tp=2, limits=big), kv_store=store)  # blocks of 32, TP2
    plain = factory.engine()
    prompt = tokens(7 * TPB, 130) + tokens(5, 131)  # 117 tokens: 7 blocks of 16 published, 3 of 32 usable
    assert run(publisher, "a", prompt, 8) == run(plain, "a", prompt, 8)
    assert run(importer, "b", prompt, 8) == run(plain, "b", prompt, 8)
    assert importer.store_hits == 3 and importer.reused_blocks == 3
