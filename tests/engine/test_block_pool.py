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
    first = BlockPool(64, free_order_seed=3).allocate(64)
    assert first == BlockPool(64, free_order_seed=3).allocate(64)
    assert first != list(range(64)) and sorted(first) == list(range(64))


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
