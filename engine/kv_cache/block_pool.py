"""The KV block pool: plain-CPU bookkeeping of which cache blocks are free, cached, or held.

A block is in one of three conditions:
  * held:            ref_cnt >= 1, not in the free queue (maybe also cached);
  * free and cached: ref_cnt == 0, in the free queue, its digest in ``_cached`` (its KV is a
                     reusable prefix block until it is evicted);
  * free:            ref_cnt == 0, in the free queue, no digest.
The free queue is LRU: allocation takes from the front, evicting a cached block's digest;
freed blocks go to the back. ``check_integrity`` asserts all of this.

A block that extends a sequence is taken next to the sequence's last one where that block is
free and its contents do not matter (no digest) or are about to be evicted anyway (among the
``neighbour_window`` oldest free blocks): decode attention reads a sequence's blocks in order,
and scattered one by one they cost a decode step 1.14-1.76x (docs/benchmarks.md, "A stream's
KV in runs"). KVCacheManager takes blocks ahead, in runs, for the same reason.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Sequence

from engine.kv_cache.block_hash import BlockHash

Listener = Callable[[list[int]], None]


@dataclass(frozen=True, slots=True)
class KVEvents:
    """What changed in the prefix cache since the last ``take_events`` (net: a digest stored
    and evicted in between appears once, in its final state)."""

    stored: list[BlockHash]  # digests whose KV this pool now holds for reuse
    evicted: list[BlockHash]  # digests it no longer holds

    def __bool__(self) -> bool:
        return bool(self.stored or self.evicted)


class BlockPool:
    """Fixed-size pool of KV block ids with reference counts and a prefix cache.

    ``free_order_seed`` shuffles the initial free queue (tests use it to prove nothing
    depends on blocks being contiguous). Discard listeners are called with the ids of blocks
    whose contents just stopped mattering: freed without a digest, or evicted from the cache.
    ``neighbours``: whether a sequence's next block is taken next to its last one (the module
    docstring; default: yes, except on a shuffled pool, which is there to hand out scattered
    blocks); ``neighbour_window``: how many of the oldest free blocks such a block may be taken
    from out of LRU order even if cached (0: only uncached neighbours; default: a sixteenth of
    the pool, at most 64, so that the prefix cache's eviction order moves only among blocks
    about to be evicted anyway).
    """

    def __init__(self, num_blocks: int, free_order_seed: int | None = None, neighbours: bool | None = None,
                 neighbour_window: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if neighbour_window is None:
            neighbour_window = min(64, num_blocks // 16)
        if neighbour_window < 0:
            raise ValueError(f"neighbour_window must be >= 0, got {neighbour_window}")
        self.num_blocks = num_blocks
        self.neighbours = free_order_seed is None if neighbours is None else neighbours
        self.neighbour_window = neighbour_window
        self.num_neighbours = 0  # blocks taken next to their sequence's last one, out of LRU order
        order = list(range(num_blocks))
        if free_order_seed is not None:
            random.Random(free_order_seed).shuffle(order)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(order)  # front = evict first
        self._ref_cnt = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._discard_listeners: list[Listener] = []
        self.num_evictions = 0
        self._events: dict[BlockHash, bool] | None = None  # digest -> held now; None: not recorded

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def record_events(self) -> None:
        """Start recording stored / evicted digests (a worker that publishes them calls this)."""
        self._events = {}

    def take_events(self) -> KVEvents:
        if self._events is None:
            return KVEvents([], [])
        events, self._events = self._events, {}
        return KVEvents([d for d, held in events.items() if held], [d for d, held in events.items() if not held])

    def cached_digests(self) -> list[BlockHash]:
        """Every digest held now (to republish the whole set)."""
        return list(self._cached)

    def add_discard_listener(self, listener: Listener) -> None:
        self._discard_listeners.append(listener)

    def _discarded(self, block_ids: list[int]) -> None:
        if block_ids:
            for listener in self._discard_listeners:
                listener(block_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, tail: Sequence[int] = ()) -> list[int]:
        """Take ``num_blocks`` blocks (ref 0 -> 1), evicting their digests: each next to the
        block before it (``tail``, the block table they extend, then each one taken) where the
        neighbour may be taken (``_neighbour``), else from the LRU front. Caller checks
        ``can_allocate``."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids: list[int] = []
        prev = list(tail[-2:])
        oldest: set[int] | None = None  # the window's blocks, listed once a cached neighbour needs it
        for _ in range(num_blocks):
            block_id = None
            if prev and self.neighbours:
                block_id, oldest = self._neighbour(prev, oldest)
            if block_id is None:
                block_id = self._free.popitem(last=False)[0]
            else:
                if block_id != next(iter(self._free)):
                    self.num_neighbours += 1
                del self._free[block_id]
            block_ids.append(block_id)
            prev = [prev[-1], block_id] if prev else [block_id]
        evicted = []
        for block_id in block_ids:
            assert self._ref_cnt[block_id] == 0, f"block {block_id} in free queue with refs"
            self._ref_cnt[block_id] = 1
            digest = self._hash_of[block_id]
            if digest is not None:
                del self._cached[digest]
                self._hash_of[block_id] = None
                evicted.append(block_id)
                if self._events is not None:
                    self._events[digest] = False
        self.num_evictions += len(evicted)
        self._discarded(evicted)
        return block_ids

    def _neighbour(self, prev: list[int], oldest: set[int] | None) -> tuple[int | None, set[int] | None]:
        """A free block next to ``prev[-1]`` that may be taken out of LRU order: uncached, or
        among the ``neighbour_window`` oldest free blocks. The run's direction first (``prev``'s
        two blocks ascending or descending), then the other side."""
        block_id = prev[-1]
        step = -1 if len(prev) == 2 and prev[0] == block_id + 1 else 1
        for candidate in (block_id + step, block_id - step):
            if candidate not in self._free:
                continue  # (also out of range: the free queue holds only valid ids)
            if self._hash_of[candidate] is None:
                return candidate, oldest
            if oldest is None:
                oldest = set(islice(self._free, self.neighbour_window))
            if candidate in oldest:
                return candidate, oldest
        return None, oldest

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks (a prefix-cache hit); free ones leave the queue."""
        for block_id in block_ids:
            assert self._hash_of[block_id] is not None, f"touching uncached block {block_id}"
            if self._ref_cnt[block_id] == 0:
                del self._free[block_id]
            self._ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; at zero it joins the back of the free queue
        (cached blocks stay reusable until evicted)."""
        discarded = []
        for block_id in block_ids:
            assert self._ref_cnt[block_id] >= 1, f"double free of block {block_id}"
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                self._free[block_id] = None
                if self._hash_of[block_id] is None:
                    discarded.append(block_id)
        self._discarded(discarded)

    def cache_block(self, block_id: int, digest: BlockHash) -> bool:
        """Register a held, fully written block under its digest. False if another block
        already carries that digest (this one then stays uncached)."""
        assert self._ref_cnt[block_id] >= 1, f"caching unreferenced block {block_id}"
        if digest in self._cached or self._hash_of[block_id] is not None:
            return False
        self._cached[digest] = block_id
        self._hash_of[block_id] = digest
        if self._events is not None:
            self._events[digest] = True
        return True

    def lookup(self, digest: BlockHash) -> int | None:
        return self._cached.get(digest)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def check_integrity(self) -> None:
        for block_id in self._free:
            assert self._ref_cnt[block_id] == 0, f"free block {block_id} has refs"
        for block_id, refs in enumerate(self._ref_cnt):
            assert refs >= 0, f"block {block_id} has negative refs"
            if block_id not in self._free:
                assert refs >= 1, f"block {block_id} is neither free nor referenced (leaked)"
        assert len(self._cached) == sum(h is not None for h in self._hash_of), "digest maps disagree"
        for digest, block_id in self._cached.items():
            assert self._hash_of[block_id] == digest, f"block {block_id} digest mismatch"
