"""The index's key schema, the one place it is spelled. Keys live under the engine's namespace
digest (model, dtype, block size) and the hash version, so workers of another model or block
size never match:

    tandem:prefix:v<HASH_VERSION>:<namespace hex>:
        blocks:<worker id>:<incarnation>   SET of 16-byte block digests the worker holds
        alive:<worker id>:<incarnation>    "1" with a TTL, refreshed by the heartbeat
        seq:<worker id>:<incarnation>      INCR per published batch (one per engine step)

A worker process is one incarnation (a fresh id at each start), so a restarted worker never
inherits its predecessor's entries; readers count only incarnations whose alive key exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.block_hash import HASH_VERSION, BlockHash


def namespace_prefix(namespace: BlockHash) -> str:
    """Every key of one namespace starts with this."""
    return f"tandem:prefix:v{HASH_VERSION}:{namespace.hex()}"


@dataclass(frozen=True, slots=True)
class WorkerKeys:
    """One worker incarnation's keys in one namespace."""

    blocks: str  # SET of the block digests it holds
    alive: str  # heartbeat: exists while the incarnation lives
    seq: str  # counter of published batches

    @classmethod
    def of(cls, namespace: BlockHash, worker_id: str, incarnation: str) -> WorkerKeys:
        owner = f"{worker_id}:{incarnation}"
        prefix = namespace_prefix(namespace)
        return cls(blocks=f"{prefix}:blocks:{owner}", alive=f"{prefix}:alive:{owner}", seq=f"{prefix}:seq:{owner}")

    @classmethod
    def from_blocks_key(cls, namespace: BlockHash, key: str) -> WorkerKeys | None:
        """The keys of the incarnation that owns ``key`` (a blocks key found by a scan);
        None for a key of another namespace or kind."""
        head = f"{namespace_prefix(namespace)}:blocks:"
        if not key.startswith(head):
            return None
        worker_id, sep, incarnation = key[len(head):].rpartition(":")
        return cls.of(namespace, worker_id, incarnation) if sep else None


def blocks_pattern(namespace: BlockHash) -> str:
    """SCAN pattern matching every blocks key of the namespace."""
    return f"{namespace_prefix(namespace)}:blocks:*"
