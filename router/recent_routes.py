"""Routes this router chose a moment ago, by block digest (a local supplement to the prefix
index, which learns of a prompt's blocks only once a worker has computed them)."""

from __future__ import annotations

from collections import OrderedDict

from engine.kv_cache.block_hash import BlockHash


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
