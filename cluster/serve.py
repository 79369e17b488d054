"""`tandem serve`: start (or join) Ray, launch the worker pools, serve the HTTP gateway, and
drain on SIGTERM / Ctrl-C.

Draining: /ready turns false and new requests get 503; requests in flight get up to
--drain-timeout seconds, then the decode workers abort the rest (their streams end with
finish_reason "abort"); then every actor this command started is stopped, and a Ray it
started is shut down.

``ServeCluster`` is that lifecycle, one method a stage: ``start`` (Ray, the plan, Redis),
``serve`` (the router's front ends, then the workers behind them, until a signal has drained
them: cluster/frontend.py's ``Frontend.drain``) and ``stop`` (everything this command
started, in reverse)."""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import sys
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from cluster.autoscale import PoolSize
from cluster.placement import Mode, choose_mode, default_worker_threads
from cluster.serve_config import ServeConfig, add_serve_arguments, cluster_secret
from engine.prefill_lane import SPLIT_MIN_TOKENS
from engine.remote_kv import KVFailurePolicy
from proto.rpc import Role


def worker_gpus(requested: float | None, device: str, cluster_gpus: float) -> float:
    """GPUs one worker asks Ray for. Unset: one GPU when the cluster has any and the device may
    be CUDA, else none. ``--device cuda`` with no GPU for the worker is an error here, before
    any worker starts (it would only fail inside the actor, where Ray hides every GPU)."""
    gpus = requested if requested is not None else (1.0 if device != "cpu" and cluster_gpus >= 1 else 0.0)
    if device == "cuda" and gpus == 0:
        why = "the Ray cluster has no GPU" if cluster_gpus < 1 else "a worker that asks Ray for 0 GPUs sees none"
        raise ValueError(f"--device cuda, but {why} (give workers GPUs with --prefill-gpus / --decode-gpus)")
    if device == "cpu" and gpus > 0:
        raise ValueError("--device cpu with GPUs for the workers would leave them idle; use --device auto or cuda")
    return gpus


def add_serve_parser(commands) -> None:
    # no abbreviated flags: a deployment's command line must name each flag in full
    parser = commands.add_parser("serve", help="serve the OpenAI-compatible API from prefill and decode workers on "
                                 "Ray", allow_abbrev=False)
    add_serve_arguments(parser)
    parser.set_defaults(func=run_serve)


def say(message: str) -> None:
    print(f"[tandem serve] {message}", file=sys.stderr, flush=True)


class PlanError(ValueError):
    """The configuration cannot run on the cluster it found (exit status 2)."""


@dataclass(frozen=True)
class ServePlan:
    """What `tandem serve` derived from its config and the cluster it found."""

    mode: Mode  # DISAGG or COLOCATED (auto resolved)
    worker_threads: int
    gpus: Mapping[Role, float]  # per worker of each role
    sizes: Mapping[Role, PoolSize]  # the pools this mode runs
    max_model_len: int
    redis_url: str
    secret: str


def run_serve(args: argparse.Namespace) -> int:
    # Ray's control plane (which pickles) authenticated; Ray reads this when imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from cluster import reaper
    from cluster.actors import WorkerStartupError

    reaper.start()  # should this process be SIGKILLed, what it starts below goes with it

    cluster = ServeCluster(ServeConfig.from_namespace(args))
    try:
        cluster.start()
        return cluster.serve()
    except PlanError as exc:
        say(f"error: {exc}")
        return 2
    except WorkerStartupError as exc:
        say(f"error: {exc}")
        return 1
    finally:
        cluster.stop()


class ServeCluster:
    """Everything one `tandem serve` starts, and stops again: call ``start``, then ``serve``
    (returns once drained), and always ``stop``."""

    def __init__(self, config: ServeConfig) -> None:
        from router.policy import make_policy
        from telemetry.tracing import tracing_config

        self.config = config
        self.policy = make_policy(config.routing_policy)  # a bad choice fails before anything starts
        self.tracing = tracing_config(config.otlp_endpoint, config.trace_content)  # a bad protocol fails here too
        self.handles: dict = {}  # address -> every worker launched, whatever happens next, so that all are stopped
        self.plan: ServePlan | None = None
        self.frontend = None  # cluster.frontend.Frontend, while serving
        self._ray = None  # the ray module, once initialised
        self._started_ray = False
        self._private_redis = None
        self.namespace: str | None = None  # the Ray namespace of a joined cluster's workers

    def start(self) -> ServePlan:
        """Ray (started or joined), the model's facts, the mode and the workers' shape, and the
        prefix index's Redis: all that comes before the first worker."""
        from engine.llm import resolve_max_model_len
        from engine.model_info import load_model_info

        config, tracing = self.config, self.tracing
        say("tracing: off" if tracing is None else f"tracing: OTLP {tracing.protocol} to {tracing.endpoint}"
             + (" (with prompt and output text)" if tracing.trace_content else ""))
        say(f"loading {config.model} (fetched and converted on first use)")
        self.chat_template = open(config.chat_template).read() if config.chat_template else None
        self.info = load_model_info(config.model, self.chat_template)
        max_model_len = resolve_max_model_len(self.info.arch, config.max_model_len)
        cluster_gpus = self._start_ray()
        try:
            gpus = {role: worker_gpus(requested, config.device, cluster_gpus)
                    for role, requested in ((Role.PREFILL, config.prefill_gpus), (Role.DECODE, config.decode_gpus))}
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        nodes = self._ray.nodes()
        choice = choose_mode(config.mode, nodes, cluster_gpus, gpus[Role.PREFILL], gpus[Role.DECODE],
                             config.prefill_workers.min, config.decode_workers.min)
        threads = config.worker_threads
        if threads is None:
            threads = default_worker_threads(choice.mode, nodes, config.decode_workers.min)
        say(f"mode: {choice.mode} ({choice.reason}); {threads} torch thread(s) per worker")
        if choice.mode is Mode.COLOCATED and threads >= 2 and config.prefill_lane_min_tokens is not None:
            when = {"overflow": " and finds other prefill work under way (policy overflow)",
                    "pace": f" while the streams get tokens more than {config.prefill_lane_pace_ms:g} ms apart "
                            "(policy pace)",
                    "cost": f" while the streams get tokens more than {config.prefill_lane_pace_ms:g} ms apart, "
                            "if it costs them less there than in the steps (policy cost)"}
            when = when.get(config.prefill_lane_policy, "")
            if when and config.prefill_lane_ttft_ratio is not None:
                when += (f", and if it gives the first token within {config.prefill_lane_ttft_ratio:g}x the "
                         "steps' time (as measured)")
            helps = ("" if config.prefill_lane_help_ms is None else
                     f"; the decoding thread reads layers of a {SPLIT_MIN_TOKENS}+ token prompt's second half beside "
                     f"it while a step and a layer take at most {config.prefill_lane_help_ms:g} ms")
            say(f"prefill lane: a prompt of {config.prefill_lane_min_tokens}+ tokens that arrives while streams "
                f"decode{when} is read on 1 of the {threads} threads, the others decoding meanwhile{helps}")
        sizes = {Role.DECODE: config.decode_workers}
        if choice.mode is Mode.DISAGG:
            sizes[Role.PREFILL] = config.prefill_workers
        say("workers: " + ", ".join(
            f"{role} {'on ' + format(gpus[role], 'g') + ' GPU each' if gpus[role] else 'on the CPU'}"
            for role in (Role.PREFILL, Role.DECODE) if role in sizes))
        self.plan = ServePlan(choice.mode, threads, gpus, sizes, max_model_len, "", "")
        if config.ray_address:
            self.plan = self._join_or_attach()
        else:
            self.plan = replace(self.plan, redis_url=self._redis_url(), secret=cluster_secret())
        return self.plan

    def _join_or_attach(self) -> ServePlan:
        """On a joined cluster: attach to the live workers an earlier router started with this
        configuration (their secret and Redis from the cluster's record), or stop any started
        with another and begin afresh (cluster/detached.py)."""
        from cluster import detached

        config, plan = self.config, self.plan
        env_secret = os.environ.get("TANDEM_CLUSTER_SECRET")
        fingerprint = detached.config_fingerprint(
            self.engine_args(), plan.mode, dict(plan.gpus), config.kv_failure_policy, config.prefill_nice,
            config.worker_port, config.redis_url, self.tracing, config.worker_max_restarts, config.orphan_timeout,
            hashlib.sha256(env_secret.encode()).hexdigest() if env_secret else None)
        record = detached.read_record(self.namespace)
        live = detached.live_workers(timeout_s=30.0)
        redis_url = config.redis_url or (detached.index_url() if record else None)
        if live and record is not None and record.fingerprint == fingerprint and redis_url == record.redis_url:
            self.handles.update({handle.address: handle for handle in live})
            say(f"attached to {len(live)} live workers in Ray namespace {self.namespace} (started by an earlier "
                "router with this configuration)")
            return replace(plan, secret=record.secret, redis_url=record.redis_url)
        if live or record is not None:
            say(f"Ray namespace {self.namespace}: stopping what an earlier router started with another "
                "configuration (or without its prefix index)")
        for handle in live:
            self._ray.kill(handle.actor, no_restart=True)
        detached.stop_named([detached.INDEX_ACTOR])
        if not config.redis_url:
            redis_url = detached.start_index(config.orphan_timeout or None)
            say(f"prefix index: private Redis in the detached actor {detached.INDEX_ACTOR}")
        record = detached.ClusterRecord(cluster_secret(), redis_url, fingerprint)
        detached.write_record(self.namespace, record)
        return replace(plan, secret=record.secret, redis_url=record.redis_url)

    def _start_ray(self) -> float:
        """Start Ray (or join ``--ray-address``); the cluster's GPUs."""
        import ray

        from cluster.actors import init_ray

        self._ray = ray
        if self.config.ray_address:  # its workers are detached, in a namespace of this model's (cluster/detached.py)
            from cluster.detached import cluster_namespace

            self.namespace = cluster_namespace(self.config.name)
            init_ray(address=self.config.ray_address, namespace=self.namespace, logging_level="warning")
        else:
            # Ray starts its workers at niceness 15 by default: below the router and every other
            # process, so a busy machine preempts decode steps first. Ours run at 0 (prefill
            # workers then lower themselves by --prefill-nice).
            os.environ.setdefault("RAY_worker_niceness", "0")
            # no idle worker prestarted for tasks (tandem runs actors only) and no Ray metrics
            # export (tandem's own /metrics reads the workers' Stats): on shared cores each of
            # them woke about 100 times a second and preempted an engine thread each time
            os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
            os.environ.setdefault("RAY_enable_metrics_collection", "0")
            # room for each pool's largest size, whichever mode auto picks (a joined cluster's
            # autoscaler adds nodes instead)
            init_ray(num_cpus=os.cpu_count(), resources={Role.PREFILL.value: self.config.prefill_workers.max,
                                                         Role.DECODE.value: self.config.decode_workers.max},
                     include_dashboard=False, logging_level="warning")
            self._started_ray = True
        return float(ray.cluster_resources().get("GPU", 0.0))

    def _redis_url(self) -> str:
        if self.config.redis_url:
            return self.config.redis_url
        from cluster.redis_server import PrivateRedis

        self._private_redis = PrivateRedis(fate_share=True)  # gone with this process, even SIGKILLed
        url = self._private_redis.start()
        say(f"prefix index: private Redis on 127.0.0.1:{self._private_redis.port}")
        return url

    def engine_args(self):
        """The workers' engine, from the config and the plan."""
        from engine.llm import EngineArgs

        config, plan = self.config, self.plan
        lane = config.prefill_lane_min_tokens if plan.mode is Mode.COLOCATED else None
        return EngineArgs(model=str(self.info.model_dir), dtype=config.dtype, max_model_len=plan.max_model_len,
                          block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                          max_num_seqs=config.max_num_seqs, gpu_memory_utilization=config.gpu_memory_utilization,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_step_ms=config.max_step_ms,
                          prefill_lane_min_tokens=lane, prefill_lane_max_wait_ms=config.prefill_lane_max_wait_ms,
                          prefill_lane_policy=config.prefill_lane_policy,
                          prefill_lane_pace_ms=config.prefill_lane_pace_ms,
                          prefill_lane_help_ms=config.prefill_lane_help_ms,
                          prefill_lane_ttft_ratio=config.prefill_lane_ttft_ratio,
                          scheduling_policy=config.scheduling_policy,
                          num_threads=plan.worker_threads, chat_template=self.chat_template,
                          attention_backend=config.attention_backend, device=config.device,
                          enforce_eager=config.enforce_eager, served_model_name=config.name)

    def serve(self) -> int:
        """The router's HTTP and gRPC front ends come up first (not ready: /ready 503, health
        NOT_SERVING), then the workers start; it turns ready when they are. Returns once a
        signal has drained it."""
        from cluster.frontend import Frontend

        workers = WorkerLauncher(self.engine_args(), self.config, self.plan, self.tracing, self.handles)
        self.frontend = Frontend(self.config, self.plan, self.info, self.policy, self.tracing, workers)
        self.frontend.run()
        return 0

    def stop(self) -> None:
        """Every actor this command started, the Ray it started and its private Redis."""
        pids = []
        if self._ray is not None:
            from cluster.actors import worker_processes

            pids = worker_processes(list(self.handles.values())) if self._ray.is_initialized() else []
            for handle in self.handles.values():
                self._ray.kill(handle.actor, no_restart=True)
            self.handles.clear()
            if self.namespace is not None and self._ray.is_initialized():
                from cluster import detached

                detached.stop_named([detached.INDEX_ACTOR])
                detached.delete_record(self.namespace)
            if self._started_ray:
                self._ray.shutdown()
        _reap(pids)
        if self._private_redis is not None:
            self._private_redis.close()
        say("stopped")


def _reap(pids: list[int]) -> None:
    """The killed workers' processes on this node end, by SIGKILL where Ray's kill left them."""
    from cluster.actors import reap

    killed = reap(pids)
    if killed:
        say(f"worker process(es) {', '.join(map(str, killed))} outlived their actors' kill: sent SIGKILL")


class WorkerLauncher:
    """Starts and stops this command's workers (blocking calls: run them in threads). Every
    worker started is in ``handles`` (address -> WorkerHandle) until it is stopped, so that
    shutdown stops them all."""

    def __init__(self, engine, config: ServeConfig, plan: ServePlan, tracing, handles: dict) -> None:
        from cluster.actors import Placement
        from decode_worker.worker import DecodeWorkerConfig
        from prefill_worker.worker import PrefillWorkerConfig
        from prefix_index.publisher import PrefixIndexConfig
        from worker_runtime.server import ServerConfig

        server = ServerConfig("", config.worker_port, plan.secret)
        index = PrefixIndexConfig(plan.redis_url)
        joined = config.ray_address is not None  # detached, so that they outlive this router
        placement = Placement(ready_timeout_s=config.ready_timeout, max_restarts=config.worker_max_restarts,
                              detached=joined, orphan_timeout_s=(config.orphan_timeout or None) if joined else None)
        self.configs = {
            Role.PREFILL: PrefillWorkerConfig(engine, server, prefix_index=index, tracing=tracing),
            Role.DECODE: DecodeWorkerConfig(engine, server, prefix_index=index, tracing=tracing,
                                            kv_failure_policy=KVFailurePolicy(config.kv_failure_policy)),
        }
        self.placements = {
            Role.PREFILL: replace(placement, nice=max(0, config.prefill_nice), num_gpus=plan.gpus[Role.PREFILL]),
            Role.DECODE: replace(placement, num_gpus=plan.gpus[Role.DECODE]),
        }
        self.threads = plan.worker_threads
        self.handles = handles

    def start(self, role: Role) -> str:
        """One worker, once it serves: its address."""
        from cluster.actors import launch_worker

        placement = self.placements[role]
        name = None
        if placement.detached:
            from cluster.detached import worker_name

            name = worker_name(role)
        handle = launch_worker(role, self.configs[role], placement, name)
        self.handles[handle.address] = handle
        return handle.address

    def stop(self, address: str, timeout_s: float = 30.0) -> None:
        import ray

        from cluster.actors import worker_processes

        handle = self.handles[address]
        try:
            ray.get(handle.actor.stop.remote(), timeout=timeout_s)
        except Exception as exc:  # it is killed next either way
            say(f"{handle.role} worker {handle.address} did not stop cleanly: {exc}")
        pids = worker_processes([handle])
        ray.kill(handle.actor, no_restart=True)
        del self.handles[address]
        _reap(pids)

    def launch(self, counts: Mapping[Role, int]) -> None:
        """Bring the pools up to ``counts`` (workers attached to count), starting the rest in
        parallel (blocking); then raise the first failure, if any."""
        counts = {role: max(0, count - len(self.addresses(role))) for role, count in counts.items()}
        if not any(counts.values()):
            return  # all attached (cluster/detached.py)
        say(f"starting {counts.get(Role.PREFILL, 0)} prefill and {counts[Role.DECODE]} decode workers "
             f"({self.threads} threads each)")
        began = time.monotonic()
        roles = [role for role, count in counts.items() for _ in range(count)]
        with ThreadPoolExecutor(max(1, len(roles))) as pool:
            pending = [pool.submit(self.start, role) for role in roles]
        errors = [future.exception() for future in pending if future.exception() is not None]
        for handle in self.handles.values():
            say(f"{handle.role} worker ready at {handle.address}")
        if errors:
            raise errors[0]
        say(f"workers ready in {time.monotonic() - began:.1f} s")

    def rediscover(self, address: str, timeout_s: float) -> str | None:
        """Where the worker last seen at ``address`` serves now: Ray restarts a worker that
        died, on a new port. Blocks until its actor answers (at most ``timeout_s``); None if it
        does not (still loading, stopped, or out of restarts: asked again later)."""
        from cluster.actors import WorkerStartupError

        handle = self.handles.get(address)
        if handle is None:
            return None
        try:
            found = handle.refresh(timeout_s)
        except WorkerStartupError:
            return None
        if found != address:
            self.handles[found] = self.handles.pop(address)
        return found

    def addresses(self, role: Role) -> list[str]:
        return [handle.address for handle in self.handles.values() if handle.role == role]
