"""The router's reader of the prefix-cache index (key schema: prefix_index/keys.py).

For one prompt, one Redis round trip (a Lua script that checks each worker incarnation's
heartbeat key and scans its block set along the prompt's digests) gives every worker's number
of leading blocks held. Redis unreachable or slower than ``budget_s``: the answer is None (route by load), and
the index is not asked again for ``retry_after_s`` while the client reconnects."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import redis
import redis.asyncio as aioredis

from engine.kv_cache.block_hash import BlockHash
from prefix_index.keys import WorkerKeys, blocks_pattern

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
                             incarnations: Mapping[str, str]) -> dict[str, int] | None:
        """``incarnations``: worker address -> the incarnation it publishes as ("": none).
        Returns address -> how many of ``digests`` (from the first) the worker holds now;
        workers that publish nothing or whose heartbeat expired count 0. None: the index is
        away."""
        self.num_lookups += 1
        published = [(address, incarnation) for address, incarnation in incarnations.items() if incarnation]
        if not digests or not published:
            return dict.fromkeys(incarnations, 0)
        if not self.is_available:
            self.num_unavailable += 1
            return None
        keys = []
        for address, incarnation in published:
            worker_keys = WorkerKeys.of(namespace, address, incarnation)
            keys += [worker_keys.alive, worker_keys.blocks]
        try:
            counts = await asyncio.wait_for(self._leading_hits(keys=keys, args=digests), self.budget_s)
        except (redis.RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            return None
        held = dict.fromkeys(incarnations, 0)
        held.update({address: int(count) for (address, _), count in zip(published, counts)})
        return held

    def _mark_down(self, exc: BaseException) -> None:
        if self.is_available:
            logger.warning("prefix index unavailable (%s); routing by load for %.1f s", exc or "slow",
                           self.retry_after_s)
        self.num_unavailable += 1
        self._down_until = time.monotonic() + self.retry_after_s

    async def sweep_dead(self, namespace: BlockHash) -> int:
        """Delete block sets of incarnations whose heartbeat expired (run now and then)."""
        removed = 0
        async for key in self._client.scan_iter(match=blocks_pattern(namespace), count=500):
            owner = WorkerKeys.from_blocks_key(namespace, key.decode())
            if owner is not None and not await self._client.exists(owner.alive):
                removed += await self._client.delete(owner.blocks, owner.seq)
        return removed

    async def close(self) -> None:
        await self._client.aclose()
