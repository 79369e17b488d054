"""The router's reader of the prefix-cache index (key layout: kv_transfer/prefix_events.py).

For one prompt, one Redis round trip (a Lua script that checks each worker incarnation's
heartbeat key and scans its block set along the prompt's digests) gives every worker's number
of leading blocks held. Redis unreachable or slower than ``budget_s``: the answer is None (route by load), and
the index is not asked again for ``retry_after_s`` while the client reconnects."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

import redis
import redis.asyncio as aioredis

from engine.kv_cache.block_hash import BlockHash
from kv_transfer.prefix_events import alive_key, blocks_key, key_prefix
from router.policy import WorkerView

logger = logging.getLogger(__name__)

# KEYS: (alive key, blocks key) per worker; ARGV: the prompt's block digests in order.
# Returns, per worker, how many leading digests its set holds (0 when its heartbeat expired):
# the scan runs inside Redis, so the reply is one small integer per worker.
_LEADING_HITS = """
local counts = {}
for w = 1, #KEYS, 2 do
  local n = 0
  if redis.call('EXISTS', KEYS[w]) == 1 then
    for i = 1, #ARGV do
      if redis.call('SISMEMBER', KEYS[w + 1], ARGV[i]) == 1 then n = i else break end
    end
  end
  counts[#counts + 1] = n
end
return counts
"""


class PrefixIndex:
    def __init__(self, redis_url: str, budget_s: float = 0.010, retry_after_s: float = 1.0) -> None:
        self._client = aioredis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._leading_hits = self._client.register_script(_LEADING_HITS)
        self.budget_s = budget_s
        self.retry_after_s = retry_after_s
        self._down_until = 0.0
        self.num_lookups = 0
        self.num_unavailable = 0  # lookups answered "route by load"

    async def start(self) -> None:
        """Connect (and authenticate) now, so that the first lookup is not the slow one."""
        try:
            await asyncio.wait_for(self._client.ping(), 2.0)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)

    @property
    def is_available(self) -> bool:
        return time.monotonic() >= self._down_until

    async def leading_blocks(self, namespace: BlockHash, digests: list[BlockHash],
                             workers: list[WorkerView]) -> dict[str, int] | None:
        """address -> how many of ``digests`` (from the first) the worker holds now; workers
        that publish nothing or whose heartbeat expired count 0. None: the index is away."""
        self.num_lookups += 1
        published = [w for w in workers if w.stats is not None and w.stats.prefix_incarnation]
        if not digests or not published:
            return {w.address: 0 for w in workers}
        if not self.is_available:
            self.num_unavailable += 1
            return None
        keys = []
        for worker in published:
            incarnation = worker.stats.prefix_incarnation
            keys += [alive_key(namespace, worker.address, incarnation), blocks_key(namespace, worker.address, incarnation)]
        try:
            counts = await asyncio.wait_for(self._leading_hits(keys=keys, args=digests), self.budget_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            return None
        held = {w.address: 0 for w in workers}
        held.update({worker.address: int(count) for worker, count in zip(published, counts)})
        return held

    def _mark_down(self, exc: BaseException) -> None:
        if self.is_available:
            logger.warning("prefix index unavailable (%s); routing by load for %.1f s", exc or "slow",
                           self.retry_after_s)
        self.num_unavailable += 1
        self._down_until = time.monotonic() + self.retry_after_s

    async def sweep_dead(self, namespace: BlockHash) -> int:
        """Delete block sets of incarnations whose heartbeat expired (run now and then)."""
        prefix = key_prefix(namespace)
        removed = 0
        async for key in self._client.scan_iter(match=f"{prefix}:blocks:*", count=500):
            worker = key.decode().removeprefix(f"{prefix}:blocks:")
            if not await self._client.exists(f"{prefix}:alive:{worker}"):
                removed += await self._client.delete(key, f"{prefix}:seq:{worker}")
        return removed

    async def close(self) -> None:
        await self._client.aclose()


class RecentRoutes:
    """What this router sent where in the last moments, by block digest: a prompt's blocks
    reach the Redis index only once a worker has computed them, so a burst of requests sharing
    a new prefix would otherwise scatter before the first one lands. Bounded (LRU)."""

    def __init__(self, max_entries: int = 200_000) -> None:
        self._entries: OrderedDict[tuple[str, BlockHash], None] = OrderedDict()
        self._max_entries = max_entries

    def remember(self, digests: list[BlockHash], addresses: list[str]) -> None:
        for address in addresses:
            for digest in digests:
                key = (address, digest)
                self._entries[key] = None
                self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def leading_blocks(self, digests: list[BlockHash], addresses: list[str]) -> dict[str, int]:
        held = {}
        for address in addresses:
            count = 0
            while count < len(digests) and (address, digests[count]) in self._entries:
                count += 1
            held[address] = count
        return held
