"""The workers' side of the prefix-cache index: each worker publishes the digests of the blocks
its prefix cache holds (key schema: prefix_index/keys.py). Dead incarnations' sets are
deleted by the router (``PrefixIndex.sweep_dead``). After a (re)connect the publisher
republishes its whole block set, so the index is rebuilt from what the workers hold now.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis

from engine.kv_cache.block_hash import BlockHash
from engine.kv_cache.block_pool import KVEvents
from prefix_index.keys import WorkerKeys

logger = logging.getLogger(__name__)


def connect(url: str, timeout_s: float) -> redis.Redis:
    """The one way tandem talks to Redis (redis:// or rediss://, password in the URL)."""
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


@dataclass(frozen=True, slots=True)
class PrefixIndexConfig:
    redis_url: str
    heartbeat_ttl_s: float = 10.0  # entries stop counting this long after the worker dies
    timeout_s: float = 2.0  # each Redis call (the engine never waits for one)


class PrefixEventPublisher:
    """Publishes one worker's prefix-cache events from its own thread.

    The engine thread calls ``publish`` after each step (it only queues); ``snapshot`` returns
    every digest held now and is called at (re)connect to republish the full set. Redis being
    down never blocks or fails the engine: batches are dropped while it is away, and the
    republish after reconnecting makes the index whole again."""

    def __init__(self, config: PrefixIndexConfig, namespace: BlockHash, worker_id: str,
                 snapshot: Callable[[], list[BlockHash]]) -> None:
        self.config = config
        self.namespace = namespace
        self.worker_id = worker_id
        self.incarnation = uuid.uuid4().hex[:12]
        self._snapshot = snapshot
        self.keys = WorkerKeys.of(namespace, worker_id, self.incarnation)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self.connected = threading.Event()
        self.num_batches = 0
        self._thread = threading.Thread(target=self._run, name="prefix-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def publish(self, events: KVEvents) -> None:
        if events:
            self._queue.put(events)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        client = connect(self.config.redis_url, self.config.timeout_s)
        backoff_s = 0.1
        while not self._stop.is_set():
            try:
                self._republish(client)
                backoff_s = 0.1
                self._serve(client)
            except redis.RedisError as exc:
                if self.connected.is_set():
                    logger.warning("prefix index unreachable (%s); retrying", exc)
                self.connected.clear()
                self._stop.wait(backoff_s)
                backoff_s = min(5.0, backoff_s * 2)
        try:
            client.delete(self.keys.alive)  # a clean stop: stop counting at once
        except redis.RedisError:
            pass

    def _republish(self, client: redis.Redis) -> None:
        while not self._queue.empty():  # the full set supersedes what was queued
            self._queue.get_nowait()
        digests = self._snapshot()
        pipe = client.pipeline(transaction=True)
        pipe.delete(self.keys.blocks)
        if digests:
            pipe.sadd(self.keys.blocks, *digests)
        pipe.set(self.keys.alive, 1, px=int(self.config.heartbeat_ttl_s * 1000))
        pipe.incr(self.keys.seq)
        pipe.execute()
        self.connected.set()
        logger.info("prefix index: published %d blocks as %s/%s", len(digests), self.worker_id, self.incarnation)

    def _serve(self, client: redis.Redis) -> None:
        beat_every_s = self.config.heartbeat_ttl_s / 3
        while not self._stop.is_set():
            try:
                events = self._queue.get(timeout=beat_every_s)
            except queue.Empty:
                events = None
            pipe = client.pipeline(transaction=True)
            if events is not None:
                if events.stored:
                    pipe.sadd(self.keys.blocks, *events.stored)
                if events.evicted:
                    pipe.srem(self.keys.blocks, *events.evicted)
                pipe.incr(self.keys.seq)
            pipe.set(self.keys.alive, 1, px=int(self.config.heartbeat_ttl_s * 1000))
            pipe.execute()
            if events is not None:
                self.num_batches += 1


def attach_publisher(core, config: PrefixIndexConfig | None, worker_id: str) -> PrefixEventPublisher | None:
    """Make ``core``'s block pool record its prefix-cache events and a publisher for them
    (started by the caller; fed by the engine loop's after-step hook). None without a config."""
    if config is None:
        return None
    core.block_pool.record_events()
    return PrefixEventPublisher(config, core.kv_manager.namespace, worker_id, core.block_pool.cached_digests)
