"""The router's pool of workers: their gRPC stubs, health (a Stats call every
``poll_interval_s``; a worker that fails it is out of routing until it answers again), and
the choice of a decode worker and, in disaggregated mode, a prefill worker per request."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.rpc import CHANNEL_OPTIONS, Role, secret_metadata
from router.outputs import OutputStreams
from router.policy import RouteRequest, RoutingPolicy, WorkerView

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Assignment:
    decode: WorkerView
    prefill: WorkerView | None  # None: the decode worker prefills (colocated, or no prefill worker serves)
    prefill_lost: bool = False  # the pool has prefill workers, but none that can take it: a local fallback


class WorkerPool:
    def __init__(self, decode_addresses: list[str], prefill_addresses: list[str], secret: str,
                 policy: RoutingPolicy, poll_interval_s: float = 0.5, stats_timeout_s: float = 2.0,
                 step_outputs: bool = True) -> None:
        self.decode = [WorkerView(Role.DECODE, a) for a in decode_addresses]
        self.prefill = [WorkerView(Role.PREFILL, a) for a in prefill_addresses]
        self.metadata = secret_metadata(secret)
        self._policy = policy
        self._poll_interval_s = poll_interval_s
        self._stats_timeout_s = stats_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None
        self.failures_to_drop = 3  # consecutive failed Stats before a worker leaves routing
        self._last_seen: dict[str, tuple[float, int, float]] = {}  # address -> (time, prompt tokens computed, busy ms)
        # decode workers' tokens in one message per engine step (router/outputs.py); None: one
        # message per token per request, on each Generate call
        self.outputs = OutputStreams(self._open_outputs) if step_outputs else None

    def add_workers(self, role: Role, addresses: list[str]) -> None:
        """Workers that started after the pool was made (they join routing once healthy)."""
        self.views(role).extend(WorkerView(role, address) for address in addresses)

    def views(self, role: Role) -> list[WorkerView]:
        """The role's workers, draining ones included (the pool's own list)."""
        return self.decode if role == Role.DECODE else self.prefill

    def replace_worker(self, worker: WorkerView, address: str) -> WorkerView:
        """The same worker, restarted at a new address (Ray restarted its actor): the old view
        leaves routing, a new one joins once its first Stats answers."""
        self.remove_worker(worker)
        view = WorkerView(worker.role, address)
        self.views(worker.role).append(view)
        return view

    def mark_unreachable(self, worker: WorkerView, why: object) -> None:
        """A call could not reach the worker: out of routing now, not after three polls; the
        next Stats it answers brings it back."""
        if worker.healthy:
            logger.warning("%s worker %s is out of routing: %s", worker.role, worker.address, why)
        worker.healthy = False
        worker.failures = max(worker.failures, self.failures_to_drop)

    def remove_worker(self, worker: WorkerView) -> None:
        """A worker that left (drained, then stopped): out of routing, health polls and metrics."""
        views = self.views(worker.role)
        if worker in views:
            views.remove(worker)
        self._last_seen.pop(worker.address, None)
        if self.outputs is not None:
            self.outputs.close(worker.address)
        channel = self._channels.pop(worker.address, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())

    def routable(self, role: Role, exclude: frozenset[str] = frozenset()) -> list[WorkerView]:
        """The role's workers that take new requests (healthy or not; draining ones and
        ``exclude`` addresses do not)."""
        return [w for w in self.views(role) if not w.draining and w.address not in exclude]

    # -- stubs --------------------------------------------------------------------------------
    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        return self._channels[address]

    def decode_stub(self, worker: WorkerView) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channel(worker.address))

    def _open_outputs(self, address: str):
        return pb_grpc.DecodeWorkerStub(self._channel(address)).Outputs(pb.OutputsRequest(), metadata=self.metadata)

    def _stats_call(self, worker: WorkerView):
        channel = self._channel(worker.address)
        stub = pb_grpc.DecodeWorkerStub(channel) if worker.role == Role.DECODE else pb_grpc.PrefillWorkerStub(channel)
        return stub.Stats(pb.StatsRequest(), metadata=self.metadata, timeout=self._stats_timeout_s)

    # -- health -------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self.outputs is not None:
            self.outputs.close_all()
        for channel in self._channels.values():
            await channel.close()

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll_interval_s)
            await self.poll_once()

    async def poll_once(self) -> None:
        workers = self.decode + self.prefill
        results = await asyncio.gather(*(self._stats_call(w) for w in workers), return_exceptions=True)
        now = time.monotonic()
        for worker, result in zip(workers, results):
            if isinstance(result, pb.WorkerStats):
                self._measure_rate(worker, result, now)
                if not worker.healthy:
                    logger.info("%s worker %s is healthy", worker.role, worker.address)
                worker.healthy, worker.stats, worker.failures = True, result, 0
            else:
                worker.failures += 1
                if worker.healthy and worker.failures >= self.failures_to_drop:
                    logger.warning("%s worker %s is out of routing: %s", worker.role, worker.address, result)
                    worker.healthy = False

    def _measure_rate(self, worker: WorkerView, stats: pb.WorkerStats, now: float) -> None:
        """A worker's prompt tokens per second of busy time: the prompt tokens it computed since
        the last poll over the time its engine spent stepping (decode-only steps included, which
        a colocated worker interleaves with its prompts under load) and in its prefill lane. Over
        the poll's wall time instead, a worker idle for most of it would look ten times slower
        than it is, and prefix routing would send a prompt away from its cached prefix to a worker
        that merely had not been measured yet. A worker that reports no step times (an older one)
        is measured over the wall time."""
        busy_ms = stats.prompt_steps_ms + stats.decode_steps_ms + stats.lane_busy_ms
        last = self._last_seen.get(worker.address)
        self._last_seen[worker.address] = (now, stats.num_prompt_tokens_computed, busy_ms)
        if last is None or stats.num_prompt_tokens_computed <= last[1] or now <= last[0]:
            return
        seconds = (busy_ms - last[2]) / 1000 if busy_ms > last[2] else now - last[0]
        sample = (stats.num_prompt_tokens_computed - last[1]) / seconds
        worker.prefill_rate = sample if not worker.prefill_rate else 0.7 * worker.prefill_rate + 0.3 * sample

    @property
    def is_ready(self) -> bool:
        """Any decode worker serves: without a prefill worker, decode workers prefill locally."""
        return any(w.healthy for w in self.routable(Role.DECODE))

    # -- dispatch -----------------------------------------------------------------------------
    def assign(self, exclude: frozenset[str] = frozenset(), route: RouteRequest | None = None) -> Assignment | None:
        """A decode worker and (disaggregated) a prefill worker, avoiding ``exclude`` addresses;
        with no prefill worker that can take it, the decode worker alone (it prefills locally)."""
        decode = self._policy.pick(self.routable(Role.DECODE, exclude), route)
        if decode is None:
            return None
        if not self.routable(Role.PREFILL):
            return Assignment(decode, None)
        prefill = self._policy.pick(self.routable(Role.PREFILL, exclude), route)
        return Assignment(decode, prefill, prefill_lost=prefill is None)
