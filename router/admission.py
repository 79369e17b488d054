"""Admission at the router: a bounded queue of requests ordered by the scheduling policy, and
SLO-aware shedding.

Every generation request holds ``num_sequences`` places (prompts x n) from admission to its
end; at most ``--max-queue`` are held at once. Past that a new request gets 429, unless it
outranks queued ones of a sheddable class: the newest of the lowest such class are shed
(429) to make room. A class is never shed for an equal or lower one.

Under ``--scheduling-policy priority`` a held request is dispatched only while the decode
workers have room (their ``max_num_seqs`` summed), or when as many sequences of lower
classes are on the workers (the decode worker then preempts them for it: a higher class
never waits here behind a lower one); the rest wait here by (priority, arrival), so that a
later request of a higher class overtakes them. Under ``fcfs`` every request is dispatched
at once, as before (the workers queue in arrival order anyway).

A sheddable class's request is shed before anything is reserved for it on a worker when the
predicted time to its first token (router/ttft.py) exceeds its class's ``ttft_ms``; the
prediction counts only the queue ahead of it, so a lower class's load never sheds a higher
class. All of this runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from engine.request_queue import SchedulingPolicy
from router.errors import APIError
from router.traffic import ClassChoice


@dataclass(eq=False, slots=True)
class Ticket:
    """One request's places in admission."""

    num_sequences: int
    choice: ClassChoice
    order: int  # arrival order among tickets
    dispatched: bool = False
    turn: asyncio.Future | None = None  # waiting to be dispatched: resolved (None or an APIError) on its turn
    released: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.choice.priority, self.order)


@dataclass(slots=True)
class AdmissionCounts:
    """What admission holds now (the router's gauges)."""

    held: int = 0  # sequences of admitted requests (queued + dispatched): at most --max-queue
    dispatched: int = 0  # of those, sequences on the workers


class Admission:
    def __init__(self, max_queue: int, policy: SchedulingPolicy, dispatch_limit: Callable[[], int],
                 on_shed: Callable[[ClassChoice, str], None] = lambda choice, why: None) -> None:
        self.max_queue = max_queue
        self.policy = policy
        self._dispatch_limit = dispatch_limit  # sequences the decode workers run at once (priority policy)
        self._on_shed = on_shed  # counts a shed request (class, reason)
        self._orders = itertools.count()
        self._queue: list[Ticket] = []  # waiting to be dispatched, by key
        self.counts = AdmissionCounts()
        self._dispatched_by_priority: dict[int, int] = {}  # priority -> its sequences on the workers

    # -- holding places -----------------------------------------------------------------------
    def hold(self, num_sequences: int, choice: ClassChoice) -> Ticket:
        """Places for a new request, or a 429 (APIError) when --max-queue is reached and no
        queued request of a lower, sheddable class can make room."""
        missing = self.counts.held + num_sequences - self.max_queue
        if missing > 0:
            self._make_room(missing, choice)
        if self.counts.held + num_sequences > self.max_queue:
            raise APIError(429, f"too many sequences in flight (--max-queue {self.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        self.counts.held += num_sequences
        return Ticket(num_sequences, choice, next(self._orders))

    def _make_room(self, missing: int, choice: ClassChoice) -> None:
        """Shed queued requests of sheddable classes below ``choice``'s, lowest class and
        newest first, if together they free ``missing`` places (else shed none)."""
        lower = sorted((t for t in self._queue if t.choice.traffic_class.sheddable
                        and t.choice.priority > choice.priority), key=lambda t: t.key, reverse=True)
        victims, freed = [], 0
        for ticket in lower:
            if freed >= missing:
                break
            victims.append(ticket)
            freed += ticket.num_sequences
        if freed < missing:
            return
        for ticket in victims:
            self._shed_queued(ticket, f"shed for a request of a higher class ({choice.traffic_class.name})")

    def _shed_queued(self, ticket: Ticket, why: str) -> None:
        self._queue.remove(ticket)
        self.release(ticket)
        self._on_shed(ticket.choice, "displaced")
        if ticket.turn is not None and not ticket.turn.done():
            ticket.turn.set_result(APIError(429, f"{why}; retry later", headers={"Retry-After": "1"}))

    def shed(self, ticket: Ticket, predicted_s: float) -> APIError:
        """Refuse a held request whose predicted time to first token misses its class's
        target: its places are released; the caller raises the error."""
        target_s = ticket.choice.traffic_class.ttft_ms / 1000
        self.release(ticket)
        self._on_shed(ticket.choice, "predicted_ttft")
        retry = max(1, math.ceil(predicted_s - target_s))
        return APIError(429, f"traffic class {ticket.choice.traffic_class.name!r} is shed: its predicted time to "
                             f"first token is {predicted_s:.1f} s against a target of {target_s:g} s; retry later",
                        headers={"Retry-After": str(retry)})

    # -- dispatch -----------------------------------------------------------------------------
    def queued_ahead(self, choice: ClassChoice) -> int:
        """Sequences that would be dispatched before a new request of ``choice``'s priority."""
        return sum(t.num_sequences for t in self._queue if t.choice.priority <= choice.priority)

    def room(self) -> int:
        """Sequences that may be dispatched now, beyond those on the workers."""
        if self.policy is SchedulingPolicy.FCFS:
            return self.max_queue
        return max(0, self._dispatch_limit() - self.counts.dispatched)

    def _can_dispatch(self, ticket: Ticket) -> bool:
        """Room on the workers, or as many sequences of lower classes there for it to displace
        (or nothing dispatched at all: a request larger than the room still goes alone)."""
        if ticket.num_sequences <= self.room() or self.counts.dispatched == 0:
            return True
        lower = sum(n for priority, n in self._dispatched_by_priority.items() if priority > ticket.choice.priority)
        return ticket.num_sequences <= lower

    async def wait_turn(self, ticket: Ticket, timeout_s: float) -> None:
        """Return once ``ticket`` may be dispatched: at once when there is room and nothing
        of its class or above waits before it; raises its APIError when it is shed while
        waiting, or 504 after ``timeout_s`` (its places are then released)."""
        if not self._queue and self._can_dispatch(ticket):
            self._dispatch(ticket)
            return
        ticket.turn = asyncio.get_running_loop().create_future()
        self._queue.append(ticket)
        self._queue.sort(key=lambda t: t.key)
        self._grant()
        try:
            outcome = await asyncio.wait_for(asyncio.shield(ticket.turn), timeout_s)
        except TimeoutError:
            self._leave_queue(ticket)
            raise APIError(504, "the request did not get a place on the workers within its --request-timeout "
                                f"(it waited {timeout_s:.3g} s in the admission queue)") from None
        except asyncio.CancelledError:  # the client went away while it waited
            self._leave_queue(ticket)
            raise
        if isinstance(outcome, APIError):
            raise outcome

    def _leave_queue(self, ticket: Ticket) -> None:
        if ticket in self._queue:
            self._queue.remove(ticket)
        if not ticket.dispatched:
            self.release(ticket)

    def _dispatch(self, ticket: Ticket) -> None:
        ticket.dispatched = True
        self.counts.dispatched += ticket.num_sequences
        priority = ticket.choice.priority
        self._dispatched_by_priority[priority] = self._dispatched_by_priority.get(priority, 0) + ticket.num_sequences

    def _grant(self) -> None:
        """Dispatch queued requests in order while ``_can_dispatch`` allows."""
        while self._queue:
            head = self._queue[0]
            if not self._can_dispatch(head):
                return
            self._queue.pop(0)
            self._dispatch(head)
            if head.turn is not None and not head.turn.done():
                head.turn.set_result(None)

    def release(self, ticket: Ticket) -> None:
        """The request is over (or was shed): free its places, dispatch what now fits.
        Idempotent."""
        if ticket.released:
            return
        ticket.released = True
        self.counts.held -= ticket.num_sequences
        if ticket.dispatched:
            self.counts.dispatched -= ticket.num_sequences
            self._dispatched_by_priority[ticket.choice.priority] -= ticket.num_sequences
        self._grant()

    def queued(self, traffic_class: str) -> int:
        """Sequences of a class waiting here (the router's gauge, read at scrape time)."""
        return sum(t.num_sequences for t in self._queue if t.choice.traffic_class.name == traffic_class)

    # -- tokenize endpoints -----------------------------------------------------------------
    def hold_plain(self, num_sequences: int) -> None:
        """Places for work that is not dispatched (tokenize calls): counted, never queued."""
        if self.counts.held + num_sequences > self.max_queue:
            raise APIError(429, f"too many sequences in flight (--max-queue {self.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        self.counts.held += num_sequences

    def release_plain(self, num_sequences: int) -> None:
        self.counts.held -= num_sequences
        self._grant()
