"""Which workers serve a request. A policy sees the router's view of each worker (its last
Stats and what the router itself has in flight there) and returns the chosen ones.

- ``round-robin``: the next healthy worker of each role in turn.
- ``load``: the decode worker with the lowest
      (running + waiting + router_in_flight) / max(1, free_kv_blocks / num_kv_blocks * 100)
  i.e. fewest sequences per percent of free KV (ties: fewest in flight, then address), and
  the prefill worker with the lowest router_prompt_tokens_in_flight + waiting (its queued
  prompt work as this router knows it; ties by address).
- ``prefix`` (prefix_index/reader.py supplies, per request, each worker's leading cached
  tokens ``hit``; without it, it is ``load``):
    decode worker: the lowest
        2 x (1 - hit / prompt_tokens) + sequences / (sequences + 8) + (1 - free_kv / num_kv)
      where sequences = max(router_in_flight, running + waiting): the prefix term dominates
      (the next turn of a chat goes where its history is), the load terms (each in [0, 1))
      break ties and push work away from a worker whose queue and KV fill up;
    prefill worker: the lowest predicted time to first token
      = (its queued prompt tokens + prompt_tokens - hit) / its prefill rate (prompt tokens per
      second of its engine's compute time, a moving average over its Stats; until measured, its
      measured peers' mean, or PREFILL_RATE_DEFAULT while none is: unmeasured_prefill_rate()).
    The KV transfer time is the same for every prefill worker once the decode worker is
    chosen, so it does not change the choice. Whether to use a prefill worker at all is the
    dispatcher's call (--local-prefill-max-tokens against the suffix the decode worker lacks).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from proto import worker_pb2 as pb
from proto.rpc import Role


@dataclass(slots=True)
class WorkerView:
    """The router's picture of one worker."""

    role: Role
    address: str  # host:port
    healthy: bool = False  # answered its last Stats in time
    stats: pb.WorkerStats | None = None  # last Stats
    in_flight: int = 0  # requests this router has there now
    prompt_tokens_in_flight: int = 0  # prompt tokens of those (prefill load)
    failures: int = field(default=0)  # consecutive failed Stats calls
    prefill_rate: float = 0.0  # prompt tokens/s it computed while busy (moving average; 0: unknown)
    draining: bool = False  # leaving the pool (autoscaling): no new requests, those in flight finish


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the request being placed."""

    num_prompt_tokens: int
    hits: dict[str, int] | None = None  # address -> leading prompt tokens cached there; None: unknown
    digests: tuple[bytes, ...] = ()  # the prompt's full-block digests (prefix routing)
    indexed_hits: dict[str, int] | None = None  # hits the index confirms (``hits`` adds prompts just routed)


class RoutingPolicy(ABC):
    """Called on the router's event loop; must not block. Returns None when no healthy worker."""

    @abstractmethod
    def pick(self, workers: list[WorkerView], route: RouteRequest | None = None) -> WorkerView | None: ...


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}  # per role: decode and prefill turn separately

    def pick(self, workers: list[WorkerView], route: RouteRequest | None = None) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        counter = self._counters.setdefault(healthy[0].role, itertools.count())
        return healthy[next(counter) % len(healthy)]


class LoadPolicy(RoutingPolicy):
    def pick(self, workers: list[WorkerView], route: RouteRequest | None = None) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        return min(healthy, key=self._score)

    @staticmethod
    def _score(worker: WorkerView) -> tuple:
        stats = worker.stats
        if worker.role == Role.PREFILL:
            waiting = stats.num_waiting if stats else 0
            return (worker.prompt_tokens_in_flight + waiting, worker.address)
        sequences = worker.in_flight + (stats.num_running + stats.num_waiting if stats else 0)
        free_percent = 100.0 * stats.num_free_kv_blocks / stats.num_kv_blocks if stats and stats.num_kv_blocks else 100.0
        return (sequences / max(1.0, free_percent), worker.in_flight, worker.address)


PREFILL_RATE_DEFAULT = 2000.0  # prompt tokens/s assumed while no worker of the pool is measured


def unmeasured_prefill_rate(peers: list[WorkerView]) -> float:
    """The prompt tokens/s to expect of a worker not yet measured: its measured ``peers``' mean
    (they serve the same model), PREFILL_RATE_DEFAULT while none is. A constant would make a new
    worker look faster or slower than its peers depending on the hardware, and win or lose
    prompts for it."""
    measured = [w.prefill_rate for w in peers if w.prefill_rate]
    return sum(measured) / len(measured) if measured else PREFILL_RATE_DEFAULT


class PrefixPolicy(RoutingPolicy):
    def pick(self, workers: list[WorkerView], route: RouteRequest | None = None) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        if route is None or route.hits is None:
            return LoadPolicy().pick(healthy)
        prompt = max(1, route.num_prompt_tokens)
        if healthy[0].role == Role.DECODE:
            def score(worker: WorkerView) -> tuple:
                stats = worker.stats
                sequences = max(worker.in_flight, stats.num_running + stats.num_waiting if stats else 0)
                kv_used = 1 - stats.num_free_kv_blocks / stats.num_kv_blocks if stats and stats.num_kv_blocks else 0
                uncached = 1 - min(route.hits.get(worker.address, 0), prompt) / prompt
                return (2 * uncached + sequences / (sequences + 8) + kv_used, worker.address)
        else:
            unmeasured = unmeasured_prefill_rate(healthy)

            def score(worker: WorkerView) -> tuple:
                rate = worker.prefill_rate or unmeasured
                queued = worker.prompt_tokens_in_flight + (worker.stats.num_waiting if worker.stats else 0)
                return ((queued + prompt - route.hits.get(worker.address, 0)) / rate, worker.address)
        return min(healthy, key=score)


POLICIES = {"round-robin": RoundRobinPolicy, "load": LoadPolicy, "prefix": PrefixPolicy}


def make_policy(name: str) -> RoutingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()
