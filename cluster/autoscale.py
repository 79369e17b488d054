"""Pool autoscaling: the router changes how many prefill and decode actors run; Ray's
autoscaler (KubeRay's in-tree one on Kubernetes, the cluster launcher on VMs) adds or removes
the nodes that hold them, because each actor asks for one unit of its role's resource.

Each pool has bounds ``MIN:MAX`` (``--prefill-workers`` / ``--decode-workers``) and a queue:

- prefill: the prompt tokens this router has sent to the pool's workers that are not yet
  prefilled (``WorkerView.prompt_tokens_in_flight``), per worker;
- decode: the sequences the pool's workers hold waiting (``WorkerStats.num_waiting``: no free
  KV or no batch slot), per worker.

Grow by one worker when the queue per worker stays above its target for the whole
``--scale-up-window``. Shrink by one when, for the whole ``--scale-down-window``, the pool
was quiet: at least one of its workers had nothing in flight, and its queue spread over one
worker fewer stayed at or under half the target (the gap between the two thresholds keeps a
pool from flapping). The emptiest worker (the newest on ties) leaves routing, finishes what
it holds (``--drain-timeout`` at most), and only then is stopped. One change per pool at a time; the windows start over
after each. A worker that cannot start (no node came up in ``--ready-timeout``) is logged
and retried after another window, never left half-added.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from proto.rpc import Role
from router.policy import WorkerView

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PoolSize:
    min: int
    max: int

    @property
    def autoscaled(self) -> bool:
        return self.max > self.min

    def __str__(self) -> str:
        return str(self.min) if not self.autoscaled else f"{self.min}:{self.max}"


def pool_size(text: str) -> PoolSize:
    """``N`` (a fixed pool) or ``MIN:MAX`` (autoscaled between them); an argparse type."""
    low, sep, high = str(text).partition(":")
    try:
        size = PoolSize(int(low), int(high) if sep else int(low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX (whole numbers), got {text!r}") from None
    if size.min < 1 or size.max < size.min:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return size


@dataclass(frozen=True, slots=True)
class ScaleRule:
    queue_target: float  # queue per worker above which the pool grows
    up_window_s: float
    down_window_s: float


@dataclass(slots=True)
class ScaleDecider:
    """When to grow or shrink one pool, from samples of its queue (pure: time is passed in)."""

    size: PoolSize
    rule: ScaleRule
    _above_since: float | None = None
    _idle_since: float | None = None
    _hold_until: float = 0.0

    def observe(self, now: float, workers: int, queue: float, one_idle: bool) -> int:
        """+1 to add a worker, -1 to drain one, 0 to leave the pool as it is."""
        if now < self._hold_until:
            return 0
        above = workers > 0 and queue / workers > self.rule.queue_target
        self._above_since = (self._above_since if self._above_since is not None else now) if above else None
        # quiet: one worker fewer would still sit under half the target (hysteresis), and one holds nothing
        idle = one_idle and workers > 1 and queue / (workers - 1) <= self.rule.queue_target / 2
        self._idle_since = (self._idle_since if self._idle_since is not None else now) if idle else None
        if workers < self.size.min:
            return +1  # back to the floor (a worker was lost or failed to start)
        if above and workers < self.size.max and now - self._above_since >= self.rule.up_window_s:
            return +1
        if idle and workers > self.size.min and now - self._idle_since >= self.rule.down_window_s:
            return -1
        return 0

    def restart(self, now: float, hold_s: float = 0.0) -> None:
        """After a change (or a failed one): both windows start over, and nothing happens
        before ``now + hold_s``."""
        self._above_since = self._idle_since = None
        self._hold_until = now + hold_s


def pool_queue(role: Role, workers: list[WorkerView]) -> float:
    if role == Role.PREFILL:
        return float(sum(w.prompt_tokens_in_flight for w in workers))
    return float(sum(w.stats.num_waiting for w in workers if w.stats is not None))


def is_empty(worker: WorkerView) -> bool:
    """Nothing of this router's in flight there, and (by its last Stats) nothing held there."""
    stats = worker.stats
    held = stats is not None and (stats.num_running or stats.num_waiting or stats.num_waiting_for_remote_kv
                                  or stats.num_in_lane or stats.num_held_transfers)
    return worker.in_flight == 0 and not held


@dataclass(slots=True)
class _PoolState:
    decider: ScaleDecider
    changing: asyncio.Task | None = None
    starting: int = 0
    events: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0, "failed": 0})


class PoolAutoscaler:
    """The loop that applies ScaleDecider to the router's WorkerPool.

    ``start_worker(role)`` starts one worker and returns its address; ``stop_worker(address)``
    stops one. Both block (they run in a thread). A drained worker is stopped only after a
    Stats poll taken after its last request finished shows it empty."""

    def __init__(self, pool, sizes: dict[str, PoolSize], rules: dict[str, ScaleRule],
                 start_worker: Callable[[str], str], stop_worker: Callable[[str], None],
                 interval_s: float = 2.0, drain_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.pools = {role: _PoolState(ScaleDecider(sizes[role], rules[role])) for role in sizes}
        self._start_worker, self._stop_worker = start_worker, stop_worker
        self.interval_s, self.drain_timeout_s, self._clock = interval_s, drain_timeout_s, clock
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in [self._task, *(p.changing for p in self.pools.values())] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.step()
            except Exception:  # never let one bad look stop autoscaling for good
                logger.exception("autoscaling: a step failed")

    def step(self) -> None:
        """One look at every pool; starts at most one change per pool."""
        now = self._clock()
        for role, state in self.pools.items():
            if state.changing is not None and not state.changing.done():
                continue
            workers = self.pool.routable(role)
            decision = state.decider.observe(now, len(workers), pool_queue(role, workers),
                                             any(w.healthy and is_empty(w) for w in workers))
            if decision > 0:
                state.changing = asyncio.create_task(self._grow(role, state))
            elif decision < 0:
                state.changing = asyncio.create_task(self._shrink(role, state, workers))

    async def _grow(self, role: str, state: _PoolState) -> None:
        logger.info("autoscaling: adding a %s worker", role)
        state.starting += 1
        try:
            address = await asyncio.get_running_loop().run_in_executor(None, self._start_worker, role)
        except Exception as exc:  # no node came up, or the worker failed: try again after a window
            state.events["failed"] += 1
            logger.warning("autoscaling: a new %s worker did not start: %s", role, exc)
            state.decider.restart(self._clock(), state.decider.rule.up_window_s)
            return
        finally:
            state.starting -= 1
        self.pool.add_workers(role, [address])
        state.events["up"] += 1
        logger.info("autoscaling: %s worker %s joined (%d now)", role, address, len(self.pool.routable(role)))
        state.decider.restart(self._clock())

    async def _shrink(self, role: str, state: _PoolState, workers: list[WorkerView]) -> None:
        # the emptiest worker; among equals the newest (the pool's order is start order)
        worker = min(reversed(workers), key=lambda w: (not is_empty(w), w.in_flight, w.prompt_tokens_in_flight))
        worker.draining = True
        logger.info("autoscaling: draining %s worker %s", role, worker.address)
        try:
            await self._wait_empty(worker)
            self.pool.remove_worker(worker)
            try:
                await asyncio.get_running_loop().run_in_executor(None, self._stop_worker, worker.address)
            except Exception as exc:  # out of routing already; shutdown kills what is left
                logger.warning("autoscaling: stopping %s worker %s failed: %s", role, worker.address, exc)
            state.events["down"] += 1
            logger.info("autoscaling: %s worker %s stopped (%d now)", role, worker.address,
                        len(self.pool.routable(role)))
        finally:
            state.decider.restart(self._clock())

    async def _wait_empty(self, worker: WorkerView) -> None:
        """Until nothing of this router's is in flight there and a Stats poll taken after that
        shows it holds nothing (KV still being sent counts); ``drain_timeout_s`` at most."""
        deadline = self._clock() + self.drain_timeout_s
        while self._clock() < deadline:
            if worker.in_flight == 0:
                seen = worker.stats
                while worker.stats is seen and self._clock() < deadline:  # a poll after the last request
                    await asyncio.sleep(0.05)
                if worker.in_flight == 0 and is_empty(worker):
                    return
            await asyncio.sleep(0.05)
        logger.warning("autoscaling: %s worker %s still busy after %.0f s; stopping it anyway "
                       "(its requests are retried or recomputed elsewhere)", worker.role, worker.address,
                       self.drain_timeout_s)

    # -- metrics --------------------------------------------------------------------------------
    def collect(self):
        workers = GaugeMetricFamily("tandem:pool_workers", "Workers per pool and state (ready: healthy and "
                                    "routable; starting; draining)", labels=["role", "state"])
        bounds = GaugeMetricFamily("tandem:pool_size_bounds", "The pool's --prefill-workers/--decode-workers "
                                   "bounds", labels=["role", "bound"])
        queue = GaugeMetricFamily("tandem:pool_queue", "What autoscaling watches: queued prompt tokens "
                                  "(prefill) or waiting sequences (decode), per worker", labels=["role"])
        events = CounterMetricFamily("tandem:pool_scaling_events", "Autoscaling changes (up, down) and workers "
                                     "that failed to start (failed)", labels=["role", "event"])
        for role, state in self.pools.items():
            routable = self.pool.routable(role)
            workers.add_metric([role, "ready"], sum(w.healthy for w in routable))
            workers.add_metric([role, "starting"], state.starting)
            workers.add_metric([role, "draining"], sum(w.draining for w in self.pool.views(role)))
            bounds.add_metric([role, "min"], state.decider.size.min)
            bounds.add_metric([role, "max"], state.decider.size.max)
            queue.add_metric([role], pool_queue(role, routable) / max(1, len(routable)))
            for event, count in state.events.items():
                events.add_metric([role, event], count)
        yield from (workers, bounds, queue, events)
