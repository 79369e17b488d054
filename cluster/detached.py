"""Workers that outlive their router: `tandem serve --ray-address`.

On a Ray cluster that `tandem serve` joins (rather than starts), the workers are detached
named actors (``prefill-<id>``, ``decode-<id>``) in a Ray namespace derived from the served
model name. What a later router needs in order to talk to them lives in Ray's internal KV
store under that namespace (a ``ClusterRecord``: the cluster secret, the prefix index's Redis
URL, and a fingerprint of the configuration the workers were started with). A router started
again against the same cluster, with the same configuration, finds them by name, attaches
within seconds (no model load), and serves; one started with another configuration stops
them and starts its own.

Where no ``--redis-url`` is given, the private Redis runs under a detached actor of the same
namespace (``prefix-index``) on the router's node, so that it survives the router too; it
listens on that node's Ray address, which workers on every node reach.

A worker that no router has called for ``--orphan-timeout`` drains and ends itself
(cluster/actors.py); the private Redis ends once it has had no client for as long. A drained
router (SIGTERM) stops all of them and deletes the record, as without ``--ray-address``."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import ray

from cluster.actors import WorkerHandle, WorkerStartupError, attach_worker
from proto.rpc import Role

RECORD_KEY = b"tandem-cluster"
INDEX_ACTOR = "prefix-index"
logger = logging.getLogger(__name__)


def cluster_namespace(served_model_name: str) -> str:
    """``tandem-`` and the served name, lowered, with anything but letters, digits, ``.``,
    ``_`` and ``-`` replaced; a short hash of the exact name is added where that changed it,
    so that two names never share a namespace."""
    slug = re.sub(r"[^a-z0-9._-]", "-", served_model_name.lower())
    if slug != served_model_name:
        slug += "-" + hashlib.sha256(served_model_name.encode()).hexdigest()[:8]
    return f"tandem-{slug}"


def config_fingerprint(*parts) -> str:
    """A digest of what the workers were started with (dataclasses and plain values)."""
    plain = [asdict(part) if hasattr(part, "__dataclass_fields__") else part for part in parts]
    return hashlib.sha256(json.dumps(plain, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class ClusterRecord:
    secret: str
    redis_url: str
    fingerprint: str

    def dumps(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def loads(cls, data: bytes | None) -> ClusterRecord | None:
        """None for a missing or unreadable record (then the cluster starts afresh)."""
        try:
            fields = json.loads(data)
            return cls(str(fields["secret"]), str(fields["redis_url"]), str(fields["fingerprint"]))
        except (TypeError, ValueError, KeyError):
            return None


def read_record(namespace: str) -> ClusterRecord | None:
    from ray.experimental.internal_kv import _internal_kv_get

    return ClusterRecord.loads(_internal_kv_get(RECORD_KEY, namespace=namespace))


def write_record(namespace: str, record: ClusterRecord) -> None:
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(RECORD_KEY, record.dumps(), overwrite=True, namespace=namespace)


def delete_record(namespace: str) -> None:
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(RECORD_KEY, namespace=namespace)


def worker_name(role: Role) -> str:
    import uuid

    return f"{role}-{uuid.uuid4().hex[:12]}"


def live_workers(timeout_s: float) -> list[WorkerHandle]:
    """The worker actors of this driver's namespace that answer within ``timeout_s`` (a
    restarting one gets that long to load); those that do not are killed."""
    named = []
    for name in ray.util.list_named_actors():
        role = name.partition("-")[0]
        if role in tuple(Role):
            try:
                named.append((Role(role), ray.get_actor(name)))
            except ValueError:  # gone since it was listed
                continue
    if not named:
        return []

    def attach(role_actor):
        try:
            return attach_worker(*role_actor, timeout_s)
        except WorkerStartupError as exc:
            logger.warning("not attaching to %s: %s", role_actor[0], exc)
            ray.kill(role_actor[1], no_restart=True)
            return None

    with ThreadPoolExecutor(len(named)) as pool:
        return [handle for handle in pool.map(attach, named) if handle is not None]


def stop_named(names: list[str], timeout_s: float = 10.0) -> None:
    """Kill these actors of the namespace, if they live, and wait (``timeout_s`` at most)
    until their names are free again."""
    for name in names:
        try:
            ray.kill(ray.get_actor(name), no_restart=True)
        except ValueError:
            continue
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name)
            except ValueError:
                break
            time.sleep(0.1)


class IndexActor:
    """The private Redis of a joined cluster, as a detached actor on the router's node (its
    server dies with this actor's process). It listens on that node's Ray address only, where
    workers on other nodes reach it (with its password). Ends itself once no client has been
    connected for ``orphan_timeout_s`` (the router's index reader and every worker's publisher
    are clients)."""

    def __init__(self, orphan_timeout_s: float | None) -> None:
        from cluster.redis_server import PrivateRedis

        self.redis = PrivateRedis(fate_share=True, bind=(ray.util.get_node_ip_address(),))
        self._url = self.redis.start()
        if orphan_timeout_s:
            threading.Thread(target=self._end_when_unused, args=(orphan_timeout_s,), daemon=True).start()

    def url(self) -> str:
        return self._url

    def _end_when_unused(self, timeout_s: float) -> None:
        import redis

        me = "tandem-index-watch"
        client = redis.Redis.from_url(self._url, socket_timeout=2, socket_connect_timeout=2, client_name=me)
        last_used = time.monotonic()
        while time.monotonic() - last_used < timeout_s:
            time.sleep(min(1.0, timeout_s / 4))
            try:
                if any(entry.get("name") != me for entry in client.client_list()):
                    last_used = time.monotonic()
            except redis.RedisError:
                pass
        logger.warning("prefix index: no client for %.0f s; stopping", timeout_s)
        self.redis.close()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


def start_index(orphan_timeout_s: float | None, timeout_s: float = 60.0) -> str:
    """A fresh ``prefix-index`` actor on this node; its Redis URL."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(IndexActor).options(name=INDEX_ACTOR, lifetime="detached", num_cpus=0, max_restarts=0,
                                           scheduling_strategy=here).remote(orphan_timeout_s)
    return ray.get(actor.url.remote(), timeout=timeout_s)


def index_url(timeout_s: float = 10.0) -> str | None:
    """The URL of this namespace's live ``prefix-index`` actor, or None."""
    try:
        return ray.get(ray.get_actor(INDEX_ACTOR).url.remote(), timeout=timeout_s)
    except (ValueError, ray.exceptions.RayError):
        return None
