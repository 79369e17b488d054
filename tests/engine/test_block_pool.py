"""Block pool bookkeeping."""

from __future__ import annotations

import pytest

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager


def test_allocate_free_and_integrity():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8)) and not pool.can_allocate(1)
    pool.check_integrity()
    released = []
    pool.add_discard_listener(released.extend)
    pool.free(a)
    assert sorted(released) == sorted(a) and pool.num_free_blocks == 3
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a[0]])
    with pytest.raises(RuntimeError):
        pool.allocate(4)
    pool.free(b)
    pool.check_integrity()


def test_shuffled_order_is_deterministic_and_not_sequential():
    pool = BlockPool(64, free_order_seed=3)
    first = pool.allocate(64)
    assert first == BlockPool(64, free_order_seed=3).allocate(64)
    assert first != list(range(64)) and sorted(first) == list(range(64))
    assert pool.num_neighbours == 0  # a shuffled pool is there to scatter: it takes no neighbours


def test_a_growing_table_takes_the_free_block_next_to_its_last_one():
    pool = BlockPool(8)
    pool.allocate(8)
    pool.free([6, 2, 5, 3])  # the free queue: 6, 2, 5, 3 (front first)
    assert pool.allocate(1, tail=[0, 1]) == [2]  # next to 1, ahead of the LRU front (6)
    assert pool.allocate(2, tail=[4]) == [5, 6]  # each next to the one before it
    assert pool.allocate(1, tail=[5, 4]) == [3]  # a descending run goes on descending
    assert pool.num_neighbours == 2 and pool.num_free_blocks == 0  # 2 and 5 out of LRU order
    pool.free([7, 1])
    assert pool.allocate(1, tail=[3]) == [7]  # no free neighbour of 3: the LRU front
    pool.check_integrity()


def test_a_cached_neighbour_is_taken_only_among_the_oldest_free_blocks():
    digest = b"x" * 16
    for window, taken in ((2, 0), (4, 5)):
        pool = BlockPool(8, neighbour_window=window)
        pool.allocate(8)
        pool.cache_block(5, digest)
        pool.free([0, 1, 2, 5])  # 5 is the fourth oldest free block
        assert pool.allocate(1, tail=[3, 4]) == [taken]
        # taken out of order, a cached block's digest is evicted like any other's
        assert pool.lookup(digest) == (5 if taken != 5 else None)
        pool.check_integrity()
    pool = BlockPool(4, neighbours=False)
    pool.allocate(4)
    pool.free([3, 1])
    assert pool.allocate(1, tail=[0]) == [3]  # neighbours off: the LRU front


def test_manager_grows_tables_and_detects_leaks():
    manager = KVCacheManager(BlockPool(10), block_size=4, namespace=b"ns")
    assert manager.allocate_slots("r", 5)  # 2 blocks
    assert manager.allocate_slots("r", 8)  # still 2
    assert len(manager.block_table("r")) == 2
    assert manager.allocate_slots("r", 9) and len(manager.block_table("r")) == 3
    assert not manager.allocate_slots("s", 40)  # needs 10, 7 free: refused
    assert manager.block_table("s") == []
    manager.check_integrity()
    manager.pool.allocate(1)  # a block nobody's table holds
    with pytest.raises(AssertionError, match="held by requests"):
        manager.check_integrity()


def test_a_table_holds_blocks_ahead_in_one_run_and_gives_them_back_before_falling_short():
    manager = KVCacheManager(BlockPool(32), block_size=4, namespace=b"ns", ahead_blocks=3)
    assert manager.allocate_slots("a", 5, may_reach=40)  # 2 blocks, 3 more ahead
    assert manager.allocate_slots("b", 4, may_reach=8)  # 1 block, 1 more ahead (as far as it may grow)
    assert manager.block_table("a") == [0, 1] and manager.block_table("b") == [5]
    assert manager.num_blocks_ahead == 4 and manager.pool.num_free_blocks == 25
    manager.check_integrity()  # blocks held ahead are held, not leaked
    assert manager.allocate_slots("a", 13, may_reach=40) and manager.block_table("a") == [0, 1, 2, 3]
    assert manager.allocate_slots("a", 17, may_reach=40) and manager.block_table("a") == [0, 1, 2, 3, 4]
    assert manager.num_blocks_ahead == 1  # b's
    assert manager.allocate_slots("a", 21, may_reach=40)  # a fresh block and 3 more ahead, one run
    assert manager.block_table("a") == [0, 1, 2, 3, 4, 7] and manager.num_blocks_ahead == 4
    # 25 blocks for c: only with every block held ahead given back
    assert manager.pool.num_free_blocks == 21 and manager.allocate_slots("c", 4 * 25)
    assert manager.num_blocks_ahead == 0 and manager.pool.num_free_blocks == 0
    assert not manager.allocate_slots("b", 5, may_reach=8) and manager.block_table("b") == [5]
    manager.check_integrity()
    for request_id in ("a", "b", "c"):
        manager.free(request_id)
    assert manager.pool.num_free_blocks == 32
    manager.check_integrity()


def test_no_blocks_ahead_while_an_eighth_of_the_pool_or_less_would_stay_free():
    manager = KVCacheManager(BlockPool(16), block_size=4, namespace=b"ns", ahead_blocks=3)
    assert manager.allocate_slots("a", 4 * 11, may_reach=400)  # 11 of 16, 3 ahead would leave 2
    assert manager.num_blocks_ahead == 0 and manager.pool.num_free_blocks == 5
    manager.free("a")
    assert manager.allocate_slots("a", 4 * 10, may_reach=400)  # 10, 3 ahead leave 3 (> 16 // 8)
    assert manager.num_blocks_ahead == 3
    manager.free("a")
    assert manager.pool.num_free_blocks == 16
    manager.check_integrity()


def test_prefix_cache_events_are_net_and_only_when_recorded():
    from engine.kv_cache.block_pool import BlockPool

    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"a" * 16)
    assert not pool.take_events()  # not recording: nothing kept
    pool.record_events()
    (other,) = pool.allocate(1)
    pool.cache_block(other, b"b" * 16)
    pool.free([block, other])
    events = pool.take_events()
    assert events.stored == [b"b" * 16] and events.evicted == []
    pool.allocate(2)  # evicts both cached digests
    events = pool.take_events()
    assert sorted(events.evicted) == [b"a" * 16, b"b" * 16] and events.stored == []
    assert pool.cached_digests() == [] and not pool.take_events()


def test_an_engine_keeps_each_sequence_in_runs_unless_told_not_to(tiny_llama_dir, monkeypatch):
    """Served side by side, sequences that grow a block every 16 tokens: in runs of neighbouring
    blocks by default, scattered block by block with ``TANDEM_KV_RUNS=0``; the same tokens."""
    from engine.sampling_params import SamplingParams
    from engine.step_log import count_runs
    from tests.conftest import make_llm

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = [[10 + 7 * i + j for j in range(17 + i)] for i in range(4)]
    tokens, runs = {}, {}
    for setting in ("0", "1"):
        monkeypatch.setenv("TANDEM_KV_RUNS", setting)
        core = make_llm(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=256).engine_core
        assert core.kv_manager.ahead_blocks == (7 if setting == "1" else 0)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        for i, prompt in enumerate(prompts):
            core.add_request(core.make_request(f"r{i}", prompt, params))
        for step in range(60):
            for output in core.step():
                got[output.request_id] += output.new_token_ids
            if step == 30:  # 17-20 prompt tokens and 30 more: 3-4 blocks each, grown side by side
                runs[setting] = [count_runs(core.kv_manager.block_table(name)) for name in got]
            if not core.has_unfinished_requests():
                break
        tokens[setting] = got
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    assert all(len(ids) == 40 for ids in tokens["1"].values()) and tokens["1"] == tokens["0"]
    assert all(n == 1 for n in runs["1"]) and all(n >= 2 for n in runs["0"]), runs


def test_an_engine_gives_blocks_held_ahead_back_rather_than_make_prompts_wait(tiny_llama_dir, monkeypatch):
    """A 24-block pool: a stream holds 7 blocks ahead (6 once its next token takes one) when three
    7-block prompts come, 21 blocks with 16 free. All three are admitted in that step, as without
    blocks ahead, none is preempted, and every request gets the same tokens either way."""
    from engine.sampling_params import SamplingParams
    from tests.conftest import make_llm

    long_params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    short_params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompts = {name: [20 + 9 * i + j for j in range(100)] for i, name in enumerate("bcd")}
    tokens = {}
    for setting in ("0", "1"):
        monkeypatch.setenv("TANDEM_KV_RUNS", setting)
        core = make_llm(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=24, max_model_len=256).engine_core
        got: dict[str, list[int]] = {name: [] for name in "abcd"}
        finished: dict[str, object] = {}

        def step():
            for output in core.step():
                got[output.request_id] += output.new_token_ids
                if output.finish_reason is not None:
                    finished[output.request_id] = output

        core.add_request(core.make_request("a", list(range(30, 46)), long_params))  # 16 tokens, 116 at most
        step()
        assert core.kv_manager.num_blocks_ahead == (7 if setting == "1" else 0)  # 1 block and 7 ahead
        for name, prompt in prompts.items():
            core.add_request(core.make_request(name, prompt, short_params))
        step()
        assert all(len(got[name]) == 1 for name in "bcd"), got  # all three read in that step
        assert core.kv_manager.num_blocks_ahead == 0
        while core.has_unfinished_requests():
            step()
        assert all(finished[name].num_preemptions == 0 for name in "abcd")
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
        tokens[setting] = got
    assert len(tokens["1"]["a"]) == 100 and tokens["1"] == tokens["0"]
