"""The router's side of `tandem serve`: its state, the HTTP gateway (uvicorn) and the public
gRPC API on one event loop, the worker pools brought up behind them, and the drain a signal
starts. Imported only by ``ServeCluster.serve`` (uvicorn and the router are not needed to
parse a command line)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from cluster.autoscale import PoolAutoscaler, ScaleRule
from cluster.serve import say
from prefix_index.reader import PrefixIndex
from proto.rpc import Role
from router.app import build_app
from router.grpc_api import PublicGrpcServer
from router.limits import RequestLimits
from router.state import RouterConfig, RouterState
from router.traffic import load_traffic_classes
from router.workers import WorkerPool
from telemetry.tracing import ROUTER_SERVICE, setup_tracing

log = logging.getLogger(__name__)


def router_config(config, plan) -> RouterConfig:
    limits = RequestLimits(max_n=config.max_n, max_prompts=config.max_prompts_per_request,
                           max_stop=config.max_stop_strings, max_stop_len=config.max_stop_string_len,
                           max_input_chars=config.max_input_chars)
    return RouterConfig(served_model_name=config.name, max_model_len=plan.max_model_len, api_key=config.api_key,
                        max_queue=config.max_queue, limits=limits, tokenizer_threads=config.tokenizer_threads,
                        kv_transport=config.kv_transport_code, drain_timeout_s=config.drain_timeout,
                        local_prefill_max_tokens=config.local_prefill_max_tokens,
                        request_timeout_s=config.request_timeout, migration_limit=config.migration_limit,
                        traffic=load_traffic_classes(config.traffic_classes, config.scheduling_policy))


class DrainingServer(uvicorn.Server):
    """uvicorn whose first SIGTERM / SIGINT starts a drain (``on_signal``) instead of exiting;
    a second one exits at once."""

    def __init__(self, config: uvicorn.Config, on_signal, draining) -> None:
        super().__init__(config)
        self._on_signal, self._draining = on_signal, draining

    def handle_exit(self, sig, frame) -> None:
        if self._draining():
            return super().handle_exit(sig, frame)
        self._on_signal()


class Frontend:
    """Builds the router from the config and plan; ``run`` serves until drained."""

    def __init__(self, config, plan, info, policy, tracing_config, workers) -> None:
        self.config, self.plan, self.workers = config, plan, workers
        self.pool = WorkerPool([], [], plan.secret, policy, step_outputs=config.step_outputs)
        self.index = PrefixIndex(plan.redis_url) if config.routing_policy == "prefix" else None
        self.tracing = setup_tracing(ROUTER_SERVICE, tracing_config, f"{config.host}:{config.port}")
        self.state = RouterState(router_config(config, plan), info, self.pool, self.index, self.tracing)
        rules = {role: ScaleRule(target, config.scale_up_window, config.scale_down_window)
                 for role, target in ((Role.PREFILL, config.prefill_queue_target),
                                      (Role.DECODE, config.decode_queue_target))}
        self.autoscaler = PoolAutoscaler(self.pool, plan.sizes, rules, workers.start, workers.stop,
                                         config.autoscale_interval, config.drain_timeout)
        self.state.registry.register(self.autoscaler)
        self.tls = config.tls_credentials()
        self.public_grpc: PublicGrpcServer | None = None  # made on the serving loop (grpc.aio binds to it)
        self.server: DrainingServer | None = None
        self._sweeping: asyncio.Task | None = None
        self._rediscovering: asyncio.Task | None = None
        self._lookups = ThreadPoolExecutor(2, thread_name_prefix="rediscover")  # blocking Ray calls
        self._looking: dict[str, asyncio.Task] = {}  # address -> its lookup, while it runs

    def run(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            if self.tracing is not None:
                self.tracing.shutdown()  # exports what is still batched

    async def _serve(self) -> None:
        config = self.config
        self.public_grpc = PublicGrpcServer(self.state, config.host, config.grpc_port, self.tls)
        await self.public_grpc.start(serving=False)
        self.server = DrainingServer(uvicorn.Config(build_app(self.state), host=config.host, port=config.port,
                                                    log_level="warning", timeout_graceful_shutdown=5),
                                     on_signal=self.drain, draining=lambda: self.state.draining)
        serving = asyncio.create_task(self.server.serve())
        while not self.server.started and not serving.done():
            await asyncio.sleep(0.05)
        try:
            if self.server.started:
                say(f"listening on http://{config.host}:{config.port} and grpc {config.host}:{self.public_grpc.port}"
                     "; not ready until the workers are")
                await self._bring_up_workers(serving)
            await serving
        finally:
            await self._close(serving)

    async def _bring_up_workers(self, serving: asyncio.Task) -> None:
        """Launch the pools at their minimum sizes; once they serve, route to them and turn
        ready (unless a signal came first: then the drain goes on)."""
        counts = {role: size.min for role, size in self.plan.sizes.items()}
        launch = asyncio.get_running_loop().run_in_executor(None, self.workers.launch, counts)
        await asyncio.wait({launch, serving}, return_when=asyncio.FIRST_COMPLETED)
        if not launch.done():
            return
        launch.result()  # a worker that did not start stops everything, with its error
        for role in self.plan.sizes:
            self.pool.add_workers(role, self.workers.addresses(role))
        await self.pool.start()
        if any(size.autoscaled for size in self.plan.sizes.values()):
            await self.autoscaler.start()
            say("autoscaling: " + ", ".join(f"{role} {size}" for role, size in self.plan.sizes.items()))
        if self.index is not None:
            await self.index.start()
            self._sweeping = asyncio.create_task(_sweep_forever(self.index, self.pool))
        self._rediscovering = asyncio.create_task(self._rediscover_forever())
        if not self.state.draining:
            await self.public_grpc.set_serving(True)
            say(f"ready: http://{self.config.host}:{self.config.port}/v1 and grpc {self.config.host}:"
                 f"{self.public_grpc.port} serving {self.state.config.served_model_name} ({self.plan.mode})")

    async def _rediscover_forever(self, every_s: float = 1.0, lookup_timeout_s: float = 20.0) -> None:
        """A worker out of routing is looked up again through its Ray actor; where Ray
        restarted it on a new port, the new address replaces the old in routing (it takes
        requests once its first Stats answers)."""
        while True:
            await asyncio.sleep(every_s)
            for view in self.pool.decode + self.pool.prefill:
                if not view.healthy and view.failures and view.address not in self._looking:
                    self._looking[view.address] = asyncio.create_task(self._rediscover(view, lookup_timeout_s))

    async def _rediscover(self, view, timeout_s: float) -> None:
        try:
            found = await asyncio.get_running_loop().run_in_executor(
                self._lookups, self.workers.rediscover, view.address, timeout_s)
        finally:
            self._looking.pop(view.address, None)
        if found is not None and found != view.address and view in self.pool.views(view.role):
            self.pool.replace_worker(view, found)
            say(f"{view.role} worker {view.address} restarted at {found}")

    def drain(self) -> None:
        """No new requests (/ready false, gRPC health NOT_SERVING, the pools fixed); those in
        flight get --drain-timeout, then are aborted; then the server exits."""
        say("draining: no new requests; waiting for those in flight")
        self.state.draining = True
        loop = asyncio.get_running_loop()
        loop.create_task(self.public_grpc.set_serving(False))
        loop.create_task(self.autoscaler.stop())  # the pools stay as they are while draining
        loop.create_task(self._finish_drain())

    async def _finish_drain(self) -> None:
        state = self.state
        deadline = time.monotonic() + state.config.drain_timeout_s
        while state.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if state.num_in_flight:
            say(f"drain timeout: aborting {state.num_in_flight} requests")
            await state.dispatcher.abort_all()
            settle = time.monotonic() + 10
            while state.num_in_flight and time.monotonic() < settle:
                await asyncio.sleep(0.05)
        self.server.should_exit = True

    async def _close(self, serving: asyncio.Task) -> None:
        if not serving.done():
            self.server.should_exit = True
            await serving
        await self.public_grpc.stop()
        await self.autoscaler.stop()
        await self.pool.stop()
        if self._sweeping is not None:
            self._sweeping.cancel()
        if self._rediscovering is not None:
            self._rediscovering.cancel()
        self._lookups.shutdown(wait=False, cancel_futures=True)
        if self.index is not None:
            await self.index.close()


async def _sweep_forever(index: PrefixIndex, pool: WorkerPool, every_s: float = 30.0) -> None:
    """Delete the index entries of worker incarnations whose heartbeat expired."""
    while True:
        await asyncio.sleep(every_s)
        reference = next((w.stats for w in pool.decode + pool.prefill if w.stats and w.stats.prefix_incarnation), None)
        if reference is not None:
            try:
                await index.sweep_dead(reference.prefix_namespace)
            except Exception as exc:  # the index is best effort: never take the server down
                log.warning("prefix index sweep failed: %s", exc)
