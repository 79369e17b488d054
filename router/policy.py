"""Which workers serve a request. A policy sees the router's view of each worker (its last
Stats and what the router itself has in flight there) and returns the chosen ones.

- ``round-robin``: the next healthy worker of each role in turn.
- ``load``: the decode worker with the lowest
      (running + waiting + router_in_flight) / max(1, free_kv_blocks / num_kv_blocks * 100)
  i.e. fewest sequences per percent of free KV (ties: fewest in flight, then address), and
  the prefill worker with the lowest router_prompt_tokens_in_flight + waiting (its queued
  prompt work as this router knows it; ties by address).
- ``prefix`` comes with the Redis prefix index.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from proto import worker_pb2 as pb


@dataclass(slots=True)
class WorkerView:
    """The router's picture of one worker."""

    role: str  # "prefill" | "decode"
    address: str  # host:port
    healthy: bool = False  # answered its last Stats in time
    stats: pb.WorkerStats | None = None  # last Stats
    in_flight: int = 0  # requests this router has there now
    prompt_tokens_in_flight: int = 0  # prompt tokens of those (prefill load)
    failures: int = field(default=0)  # consecutive failed Stats calls


class RoutingPolicy(ABC):
    """Called on the router's event loop; must not block. Returns None when no healthy worker."""

    @abstractmethod
    def pick(self, workers: list[WorkerView]) -> WorkerView | None: ...


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, workers: list[WorkerView]) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        return healthy[next(self._counter) % len(healthy)] if healthy else None


class LoadPolicy(RoutingPolicy):
    def pick(self, workers: list[WorkerView]) -> WorkerView | None:
        healthy = [w for w in workers if w.healthy]
        if not healthy:
            return None
        return min(healthy, key=self._score)

    @staticmethod
    def _score(worker: WorkerView) -> tuple:
        stats = worker.stats
        if worker.role == "prefill":
            waiting = stats.num_waiting if stats else 0
            return (worker.prompt_tokens_in_flight + waiting, worker.address)
        sequences = worker.in_flight + (stats.num_running + stats.num_waiting if stats else 0)
        free_percent = 100.0 * stats.num_free_kv_blocks / stats.num_kv_blocks if stats and stats.num_kv_blocks else 100.0
        return (sequences / max(1.0, free_percent), worker.in_flight, worker.address)


POLICIES = {"round-robin": RoundRobinPolicy, "load": LoadPolicy}


def make_policy(name: str) -> RoutingPolicy:
    if name == "prefix":
        raise ValueError("--routing-policy prefix needs the Redis prefix index, which is not built yet; "
                         "use load or round-robin")
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r} (choose from {', '.join(POLICIES)})")
    return POLICIES[name]()
