"""Per-request block tables on top of the block pool."""

from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Owns every request's block table (request id -> block ids in position order).

    A request holding ``n`` tokens of KV has ``ceil(n / block_size)`` blocks:

        block table   [ b7      | b2      | b9    ....]
        positions      0 .. 15    16 .. 31  32 .. 32+k   (block_size 16; tail of b9 unused)
    """

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._tables: dict[str, list[int]] = {}

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        """Blocks to add so that the request can hold ``num_total_tokens`` tokens of KV."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_total_tokens, self.block_size) - have)

    def can_allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        return self.pool.can_allocate(self.num_new_blocks(request_id, num_total_tokens))

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> bool:
        """Grow the request's table to cover ``num_total_tokens``; False (and no change) if
        the pool is short."""
        need = self.num_new_blocks(request_id, num_total_tokens)
        if not self.pool.can_allocate(need):
            return False
        table = self._tables.setdefault(request_id, [])
        table.extend(self.pool.allocate(need))
        return True

    def free(self, request_id: str) -> None:
        """Release every block of the request (idempotent)."""
        table = self._tables.pop(request_id, None)
        if table:
            # free tail first so that, with prefix caching, the LRU keeps a prefix longest
            self.pool.free(list(reversed(table)))

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        for table in self._tables.values():
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.ref_count(block_id) == count, f"block {block_id} ref count mismatch"
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        assert in_use == len(held), f"{in_use} blocks in use but {len(held)} held by requests"
