"""The scheduler's waiting queue under each scheduling policy (vLLM's ``--scheduling-policy``).

- ``fcfs``: arrival order; a preempted request, or one whose remote KV failed, goes back to
  the front (it was running, so it is older than everything waiting).
- ``priority``: by ``(priority, arrival_time)``, lower first (vLLM's convention: priority 0
  runs before priority 10); equal keys keep their insertion order. A request that goes back
  is placed by the same key, so it never jumps a higher class.

Both queues hold WAITING and PREEMPTED requests only; the scheduler moves them in and out.
"""

from __future__ import annotations

import bisect
import enum
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator

from engine.request import Request


class SchedulingPolicy(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"


def priority_key(request: Request) -> tuple[int, float]:
    """Which of two requests goes first under the priority policy: the smaller key."""
    return (request.priority, request.arrival_time)


class RequestQueue(ABC):
    """Called on the engine thread only; nothing blocks."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """A new request."""

    @abstractmethod
    def add_back(self, request: Request) -> None:
        """A request that was running (preempted, or its remote KV failed) waits again."""

    @abstractmethod
    def peek(self) -> Request:
        """The request that is admitted next (IndexError when empty)."""

    @abstractmethod
    def pop(self) -> Request:
        """Take ``peek()``'s request out."""

    @abstractmethod
    def remove(self, request: Request) -> None:
        """Take a request out wherever it is (ValueError when absent)."""

    @abstractmethod
    def __iter__(self) -> Iterator[Request]: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._requests.append(request)

    def add_back(self, request: Request) -> None:
        self._requests.appendleft(request)

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        return self._requests.popleft()

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)


class PriorityQueue(RequestQueue):
    """A sorted list: the queue is at most a few hundred requests, and the scheduler also walks
    and removes from it, which a heap does not do cheaply."""

    def __init__(self) -> None:
        self._entries: list[tuple[int, float, int, Request]] = []  # (priority, arrival, insertion, request)
        self._insertions = itertools.count()

    def add(self, request: Request) -> None:
        priority, arrival = priority_key(request)
        bisect.insort(self._entries, (priority, arrival, next(self._insertions), request),
                      key=lambda entry: entry[:3])

    add_back = add  # placed by its key: an old request of its class is near the front anyway

    def peek(self) -> Request:
        return self._entries[0][3]

    def pop(self) -> Request:
        return self._entries.pop(0)[3]

    def remove(self, request: Request) -> None:
        for i, entry in enumerate(self._entries):
            if entry[3] is request:
                del self._entries[i]
                return
        raise ValueError(f"request {request.request_id} is not waiting")

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def make_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy is SchedulingPolicy.PRIORITY else FCFSQueue()
