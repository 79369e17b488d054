"""The KV block pool: plain-CPU bookkeeping of which cache blocks are free and who holds them.

Invariants (asserted on every transition, checked in full by ``check_integrity``):
  * every block id in [0, num_blocks) is either on the free list with ref_cnt == 0,
    or off it with ref_cnt >= 1;
  * no block is on the free list twice.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Callable


class BlockPool:
    """Fixed-size pool of KV block ids with reference counts.

    ``free_order_seed`` shuffles the initial free list (tests use it to prove that nothing
    depends on blocks being contiguous or in order). Listeners registered with
    ``add_free_listener`` are called with the ids of blocks that just became free.
    """

    def __init__(self, num_blocks: int, free_order_seed: int | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        order = list(range(num_blocks))
        if free_order_seed is not None:
            random.Random(free_order_seed).shuffle(order)
        self._free: deque[int] = deque(order)
        self._ref_cnt = [0] * num_blocks
        self._free_listeners: list[Callable[[list[int]], None]] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 .. 1.0."""
        return 1.0 - len(self._free) / self.num_blocks

    def add_free_listener(self, listener: Callable[[list[int]], None]) -> None:
        self._free_listeners.append(listener)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (ref_cnt 0 -> 1). Caller checks ``can_allocate``."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            assert self._ref_cnt[block_id] == 0, f"block {block_id} on free list with refs"
            self._ref_cnt[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the free list."""
        released = []
        for block_id in block_ids:
            assert self._ref_cnt[block_id] >= 1, f"double free of block {block_id}"
            self._ref_cnt[block_id] -= 1
            if self._ref_cnt[block_id] == 0:
                released.append(block_id)
        self._free.extend(released)
        if released:
            for listener in self._free_listeners:
                listener(released)

    def ref_count(self, block_id: int) -> int:
        return self._ref_cnt[block_id]

    def check_integrity(self) -> None:
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        for block_id in free:
            assert self._ref_cnt[block_id] == 0, f"free block {block_id} has refs"
        free_set = set(free)
        for block_id, refs in enumerate(self._ref_cnt):
            assert refs >= 0, f"block {block_id} has negative refs"
            if block_id not in free_set:
                assert refs >= 1, f"block {block_id} is neither free nor referenced (leaked)"
