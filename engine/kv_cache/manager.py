"""Per-request block tables on top of the block pool, with prefix-cache reuse."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_hash import BlockHash, hash_blocks
from engine.kv_cache.block_pool import BlockPool
from engine.request import Request

# a growing table takes blocks past its need, for its next growth, so that its KV is in runs of
# this many tokens (KVCacheManager): the block vLLM's CPU backend uses
KV_RUN_TOKENS = 128


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class PrefixCacheStats:
    num_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache
    num_hit_tokens: int = 0  # of those, tokens whose KV was reused


class KVCacheManager:
    """Owns every request's block table (request id -> block ids in position order).

    A request holding ``n`` tokens of KV has ``ceil(n / block_size)`` blocks; its leading
    full blocks may be shared with other requests through the prefix cache:

        block table   [ b7 (cached, shared) | b2 (cached) | b9 (own, partly written) ]
        positions       0 .. 15               16 .. 31      32 .. 32+k   (block_size 16)

    Only full, computed blocks are ever cached, and a cached block is never written again:
    new tokens always land in blocks past the cached prefix.

    With ``ahead_blocks``, a table that takes fresh blocks also takes up to that many more
    (next to its last where the pool has them, BlockPool.allocate) and holds them aside for its
    next growth, as far as the request may grow (``may_reach``): a stream that took one block
    per 16 tokens between other requests' blocks had its KV scattered one block at a time, and
    a served worker's free queue, and so its prompts' blocks, more scattered the longer it
    served (docs/benchmarks.md, "A stream's KV in runs"). Blocks held ahead are
    not in the table; they go back to the pool before any allocation would fall short, so they
    never refuse a request or preempt one, and only while more than an eighth of the pool is
    free are any taken.
    """

    def __init__(self, pool: BlockPool, block_size: int, namespace: BlockHash, enable_prefix_caching: bool = True,
                 ahead_blocks: int = 0):
        if ahead_blocks < 0:
            raise ValueError(f"ahead_blocks must be >= 0, got {ahead_blocks}")
        self.pool = pool
        self.block_size = block_size
        self.namespace = namespace
        self.enable_prefix_caching = enable_prefix_caching
        self.ahead_blocks = ahead_blocks
        self.stats = PrefixCacheStats()
        self._tables: dict[str, list[int]] = {}
        self._ahead: dict[str, list[int]] = {}  # request id -> blocks held for its next growth
        self._num_registered: dict[str, int] = {}  # request id -> leading blocks already cached
        # a request whose blocks another thread is writing (engine/prefill_lane.py): freeing it
        # parks its table here until that thread is done with it (unpin)
        self._pinned: set[str] = set()
        self._parked: dict[str, list[list[int]]] = {}

    @property
    def num_blocks_ahead(self) -> int:
        """Blocks held ahead for tables' next growth (in no table)."""
        return sum(len(blocks) for blocks in self._ahead.values())

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def block_hashes(self, request: Request) -> list[BlockHash]:
        """Digests of the request's full blocks (prompt and output), extended incrementally."""
        num_full = request.num_tokens // self.block_size
        if len(request.block_hashes) < num_full:
            salt = (request.cache_salt,) if request.cache_salt else ()
            request.block_hashes = hash_blocks(
                self.namespace, request.token_slice(0, num_full * self.block_size),
                self.block_size, salt, known=request.block_hashes,
            )
        return request.block_hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Leading cached blocks this request can reuse (not yet referenced). At least one
        token is always left to compute, so the step that finishes it can produce logits."""
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for digest in self.block_hashes(request)[:max_blocks]:
            block_id = self.pool.lookup(digest)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.stats.num_queried_tokens += num_queried_tokens
        self.stats.num_hit_tokens += num_hit_tokens

    def num_new_blocks(self, request_id: str, num_total_tokens: int) -> int:
        """Blocks to add so that the request can hold ``num_total_tokens`` tokens of KV."""
        have = len(self._tables.get(request_id, ()))
        return max(0, blocks_needed(num_total_tokens, self.block_size) - have)

    def allocate_slots(self, request_id: str, num_total_tokens: int, cached_blocks: list[int] = (),
                       may_reach: int = 0) -> bool:
        """Grow the request's table to cover ``num_total_tokens``, first with ``cached_blocks``
        (a prefix-cache hit, only for an empty table), then with the blocks it holds ahead, then
        with fresh blocks (and, by ``may_reach``, the tokens it may come to hold, blocks ahead:
        the class docstring). Returns False and changes nothing but the blocks held ahead
        (every request's, given back) if the pool is short."""
        need = self.num_new_blocks(request_id, num_total_tokens) - len(cached_blocks)
        # cached hits that sit in the free queue stop being allocatable once touched
        num_free_hits = sum(1 for b in cached_blocks if self.pool.ref_count(b) == 0)
        ahead = self._ahead.get(request_id, [])
        if need > len(ahead) + self.pool.num_free_blocks - num_free_hits:
            self.release_ahead()
            ahead = []
            if need > self.pool.num_free_blocks - num_free_hits:
                return False
        table = self._tables.setdefault(request_id, [])
        assert not cached_blocks or not table, "cached blocks only start a table"
        self.pool.touch(list(cached_blocks))
        table.extend(cached_blocks)
        self._num_registered.setdefault(request_id, len(cached_blocks))
        if need <= 0:
            return True
        from_ahead = ahead[:need]
        del ahead[:need]
        table.extend(from_ahead)
        fresh = need - len(from_ahead)
        if fresh:
            extra = self._extra_ahead(len(table) + fresh, fresh, may_reach)
            blocks = self.pool.allocate(fresh + extra, table)
            table.extend(blocks[:fresh])
            ahead.extend(blocks[fresh:])
        if ahead:
            self._ahead[request_id] = ahead
        else:
            self._ahead.pop(request_id, None)
        return True

    def _extra_ahead(self, num_table_blocks: int, fresh: int, may_reach: int) -> int:
        """How many blocks past ``fresh`` to take ahead for a table growing to
        ``num_table_blocks``: up to ``ahead_blocks``, as far as ``may_reach``, and none unless
        more than an eighth of the pool stays free."""
        if not self.ahead_blocks or may_reach <= 0:
            return 0
        extra = min(self.ahead_blocks, blocks_needed(may_reach, self.block_size) - num_table_blocks)
        if extra <= 0 or self.pool.num_free_blocks - fresh - extra <= self.pool.num_blocks // 8:
            return 0
        return extra

    def release_ahead(self) -> None:
        """Give every block held ahead back to the pool."""
        for blocks in self._ahead.values():
            self.pool.free(blocks)
        self._ahead.clear()

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        table = self._tables.get(request_id)
        if table is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request_id, 0)
        if num_full <= start:
            return
        hashes = self.block_hashes(request)
        for index in range(start, num_full):
            self.pool.cache_block(table[index], hashes[index])
        self._num_registered[request_id] = num_full

    def free(self, request_id: str) -> None:
        """Release every block of the request (idempotent). A pinned request's blocks stay
        held, out of its table, until ``unpin``."""
        table = self._tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        ahead = self._ahead.pop(request_id, None)
        if ahead:
            self.pool.free(ahead)  # (never written: not even a pinned request's other thread uses them)
        if table and request_id in self._pinned:
            self._parked.setdefault(request_id, []).append(table)
        elif table:
            # tail first: the LRU then evicts a sequence's last blocks before its prefix
            self.pool.free(list(reversed(table)))

    def pin(self, request_id: str) -> None:
        """Another thread writes into this request's blocks: none of them may go back to the
        pool (and to another request) before ``unpin``, even if the request ends meanwhile."""
        self._pinned.add(request_id)

    def unpin(self, request_id: str) -> None:
        """That thread is done: what the request freed while pinned goes back to the pool."""
        self._pinned.discard(request_id)
        for table in self._parked.pop(request_id, []):
            self.pool.free(list(reversed(table)))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held: dict[int, int] = {}
        parked = [table for tables in self._parked.values() for table in tables]
        for table in [*self._tables.values(), *parked, *self._ahead.values()]:
            for block_id in table:
                held[block_id] = held.get(block_id, 0) + 1
        for block_id, count in held.items():
            assert self.pool.ref_count(block_id) == count, f"block {block_id} ref count mismatch"
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        assert in_use == len(held), f"{in_use} blocks in use but {len(held)} held by requests"
