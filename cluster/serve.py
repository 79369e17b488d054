"""`tandem serve`: start (or join) Ray, launch the worker pools, serve the HTTP gateway, and
drain on SIGTERM / Ctrl-C.

Draining: /ready turns false and new requests get 503; requests in flight get up to
--drain-timeout seconds, then the decode workers abort the rest (their streams end with
finish_reason "abort"); then every actor this command started is stopped, and a Ray it
started is shut down."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from cluster.autoscale import PoolSize, pool_size
from cluster.placement import MODES, choose_mode, default_worker_threads
from engine.remote_kv import KVFailurePolicy
from engine.step_budget import DEFAULT_MAX_STEP_MS
from proto import worker_pb2
from proto.rpc import Role

_TRANSPORTS = {"grpc": worker_pb2.KV_TRANSPORT_GRPC, "torch": worker_pb2.KV_TRANSPORT_TORCH}  # --kv-transport


def _env(name: str, default, kind=str):
    value = os.environ.get(f"TANDEM_{name}")
    return default if value is None else kind(value)


def _gpus(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{text}: GPUs per worker must be in [0, 64]")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1]")
    return value


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
    from engine.models.registry import DEFAULT_MODEL

    # no abbreviated flags: a deployment's command line must name each flag in full
    p = commands.add_parser("serve", help="serve the OpenAI-compatible API from prefill and decode workers on Ray",
                            allow_abbrev=False)
    p.add_argument("--model", default=_env("MODEL", DEFAULT_MODEL))
    p.add_argument("--served-model-name", default=_env("SERVED_MODEL_NAME", None))
    p.add_argument("--dtype", default=_env("DTYPE", "auto"))
    p.add_argument("--host", default=_env("HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=_env("PORT", 8000, int))
    p.add_argument("--grpc-port", type=int, default=_env("GRPC_PORT", 50051, int), help="the public gRPC API")
    p.add_argument("--grpc-tls-cert", default=_env("GRPC_TLS_CERT", None), help="PEM certificate chain (TLS on)")
    p.add_argument("--grpc-tls-key", default=_env("GRPC_TLS_KEY", None), help="PEM private key")
    p.add_argument("--mode", choices=MODES, default=_env("MODE", "auto"),
                   help="disagg: prefill and decode pools; colocated: decode workers prefill too; auto (default): "
                        "colocated where every worker would share one node's CPU cores (or one GPU), else disagg")
    p.add_argument("--prefill-workers", type=pool_size, default=_env("PREFILL_WORKERS", "1", pool_size),
                   help="N, or MIN:MAX to autoscale the pool between them (disagg mode)")
    p.add_argument("--decode-workers", type=pool_size, default=_env("DECODE_WORKERS", "1", pool_size),
                   help="N, or MIN:MAX to autoscale the pool between them")
    p.add_argument("--prefill-queue-target", type=float, default=_env("PREFILL_QUEUE_TARGET", 2048.0, float),
                   help="autoscaling: queued prompt tokens per prefill worker above which the pool grows")
    p.add_argument("--decode-queue-target", type=float, default=_env("DECODE_QUEUE_TARGET", 4.0, float),
                   help="autoscaling: waiting sequences per decode worker above which the pool grows")
    p.add_argument("--scale-up-window", type=float, default=_env("SCALE_UP_WINDOW", 10.0, float),
                   help="autoscaling: seconds a queue must stay above its target before a worker is added")
    p.add_argument("--scale-down-window", type=float, default=_env("SCALE_DOWN_WINDOW", 60.0, float),
                   help="autoscaling: seconds a pool must stay quiet before one worker drains and stops")
    p.add_argument("--autoscale-interval", type=float, default=_env("AUTOSCALE_INTERVAL", 2.0, float),
                   help="autoscaling: seconds between looks at the queues")
    p.add_argument("--worker-threads", type=int, default=_env("WORKER_THREADS", None, int),
                   help="torch threads each worker pins (default: colocated on one node, its CPUs shared by the "
                        "decode workers; else 1)")
    p.add_argument("--prefill-gpus", type=_gpus, default=_env("PREFILL_GPUS", None, _gpus),
                   help="GPUs each prefill worker asks Ray for (Ray hides the GPUs from an actor that asks for "
                        "none); default: 1 where the Ray cluster has GPUs and --device is not cpu, else 0")
    p.add_argument("--decode-gpus", type=_gpus, default=_env("DECODE_GPUS", None, _gpus),
                   help="GPUs each decode worker asks Ray for (default: as --prefill-gpus)")
    p.add_argument("--worker-port", type=int, default=_env("WORKER_PORT", 0, int), help="0: any free port")
    p.add_argument("--ray-address", default=_env("RAY_ADDRESS", None), help="join this Ray cluster (default: start one)")
    p.add_argument("--api-key", default=_env("API_KEY", None))
    p.add_argument("--chat-template", default=_env("CHAT_TEMPLATE", None), help="a Jinja file overriding the model's")
    p.add_argument("--max-model-len", type=int, default=_env("MAX_MODEL_LEN", None, int))
    p.add_argument("--block-size", type=int, default=_env("BLOCK_SIZE", 16, int))
    p.add_argument("--num-kv-blocks", type=int, default=_env("NUM_KV_BLOCKS", None, int))
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=_env("GPU_MEMORY_UTILIZATION", 0.9, _fraction),
                   help="on a GPU without --num-kv-blocks: the share of its memory a worker may bring it to; "
                        "the KV cache gets what the weights and the activation headroom leave")
    p.add_argument("--max-num-seqs", type=int, default=_env("MAX_NUM_SEQS", 64, int))
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                   default=_env("ATTENTION_BACKEND", "auto"),
                   help="auto: Triton kernels on CUDA, torch on the CPU; triton where it cannot run is an error")
    p.add_argument("--device", choices=["cpu", "cuda", "auto"], default=_env("DEVICE", "auto"),
                   help="where each worker's model and KV cache live (auto: CUDA when the worker sees a GPU)")
    p.add_argument("--max-num-batched-tokens", type=int, default=_env("MAX_NUM_BATCHED_TOKENS", 8192, int),
                   help="tokens per forward pass: the hard cap on a prefill chunk")
    p.add_argument("--max-step-ms", type=_step_ms, default=_env("MAX_STEP_MS", DEFAULT_MAX_STEP_MS, _step_ms),
                   help="where prefill shares a step with decoding streams (colocated workers, a decode worker's "
                        "local prefill), the prompt chunk is sized from the measured prefill rate so that the "
                        f"step stays under this many ms ('off': --max-num-batched-tokens only; default "
                        f"{DEFAULT_MAX_STEP_MS:g}, measured: see README)")
    p.add_argument("--max-queue", type=int, default=_env("MAX_QUEUE", 256, int),
                   help="sequences (prompts x n) in flight before new requests get 429; tokenize calls count one")
    p.add_argument("--max-n", type=int, default=_env("MAX_N", 16, int), help="choices (n) per prompt")
    p.add_argument("--max-prompts-per-request", type=int, default=_env("MAX_PROMPTS_PER_REQUEST", 64, int),
                   help="prompts in one /v1/completions request")
    p.add_argument("--max-stop-strings", type=int, default=_env("MAX_STOP_STRINGS", 16, int),
                   help="entries in a request's stop")
    p.add_argument("--max-stop-string-len", type=int, default=_env("MAX_STOP_STRING_LEN", 256, int),
                   help="characters per stop string")
    p.add_argument("--max-input-chars", type=int, default=_env("MAX_INPUT_CHARS", 1 << 20, int),
                   help="characters of prompt or message text per request, checked before tokenizing")
    p.add_argument("--tokenizer-threads", type=int, default=_env("TOKENIZER_THREADS", 2, int),
                   help="the router's pool that tokenizes and renders chat templates (off its event loop)")
    p.add_argument("--kv-transport", choices=list(_TRANSPORTS), default=_env("KV_TRANSPORT", "grpc"))
    p.add_argument("--kv-failure-policy", choices=["recompute", "fail"], default=_env("KV_FAILURE_POLICY", "recompute"))
    p.add_argument("--routing-policy", choices=["prefix", "load", "round-robin"], default=_env("ROUTING_POLICY", "prefix"))
    p.add_argument("--redis-url", default=_env("REDIS_URL", None),
                   help="the prefix index (redis:// or rediss://, password in the URL); default: a private Redis")
    p.add_argument("--local-prefill-max-tokens", type=int, default=_env("LOCAL_PREFILL_MAX_TOKENS", 128, int),
                   help="in disagg mode, a request whose uncached suffix on the decode worker is at most this "
                        "long is prefilled there (measured crossover on this machine; see README)")
    p.add_argument("--drain-timeout", type=float, default=_env("DRAIN_TIMEOUT", 30.0, float))
    p.add_argument("--ready-timeout", type=float, default=_env("READY_TIMEOUT", 600.0, float),
                   help="seconds each worker may take to start")
    p.add_argument("--prefill-nice", type=int, default=_env("PREFILL_NICE", 10, int),
                   help="Unix niceness of prefill workers: where they share CPUs with decode workers and the "
                        "router, decode steps win (0: same priority)")
    p.add_argument("--otlp-endpoint", default=_env("OTLP_ENDPOINT", None),
                   help="export traces over OTLP here (also: the OTEL_EXPORTER_OTLP_* variables); default: off")
    p.add_argument("--trace-content", action="store_true", default=_env("TRACE_CONTENT", False, _flag),
                   help="put prompt and output text on the request spans (off: token counts only)")
    p.set_defaults(func=run_serve)


def _step_ms(value: str) -> float | None:
    if value.strip().lower() in ("off", "none", "0"):
        return None
    number = float(value)
    if not 0 < number < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"--max-step-ms must be a positive number of ms or 'off', got {value!r}")
    return number


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def _say(message: str) -> None:
    print(f"[tandem serve] {message}", file=sys.stderr, flush=True)


def run_serve(args: argparse.Namespace) -> int:
    # Ray's control plane (which pickles) authenticated; Ray reads this when imported.
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import ray

    from cluster.actors import init_ray
    from engine.llm import EngineArgs, resolve_max_model_len
    from engine.model_info import load_model_info
    from router.policy import make_policy
    from telemetry.tracing import tracing_config

    policy = make_policy(args.routing_policy)  # a bad choice fails before anything starts
    args.tracing = tracing_config(args.otlp_endpoint, args.trace_content)  # a bad protocol fails here too
    _say("tracing: off" if args.tracing is None else
         f"tracing: OTLP {args.tracing.protocol} to {args.tracing.endpoint}"
         + (" (with prompt and output text)" if args.tracing.trace_content else ""))
    _say(f"loading {args.model} (fetched and converted on first use)")
    chat_template = open(args.chat_template).read() if args.chat_template else None
    info = load_model_info(args.model, chat_template)
    max_model_len = resolve_max_model_len(info.arch, args.max_model_len)
    started_ray = not args.ray_address
    if started_ray:
        # Ray starts its workers at niceness 15 by default: below the router and every other
        # process, so a busy machine preempts decode steps first. Ours run at 0 (prefill
        # workers then lower themselves by --prefill-nice).
        os.environ.setdefault("RAY_worker_niceness", "0")
        # room for each pool's largest size, whichever mode auto picks (a joined cluster's
        # autoscaler adds nodes instead)
        init_ray(num_cpus=os.cpu_count(), resources={Role.PREFILL.value: args.prefill_workers.max,
                                                     Role.DECODE.value: args.decode_workers.max},
                 include_dashboard=False, logging_level="warning")
    else:
        init_ray(address=args.ray_address, logging_level="warning")
    cluster_gpus = float(ray.cluster_resources().get("GPU", 0.0))
    try:
        args.prefill_gpus = worker_gpus(args.prefill_gpus, args.device, cluster_gpus)
        args.decode_gpus = worker_gpus(args.decode_gpus, args.device, cluster_gpus)
    except ValueError as exc:
        _say(f"error: {exc}")
        if started_ray:
            ray.shutdown()
        return 2
    nodes = ray.nodes()
    choice = choose_mode(args.mode, nodes, cluster_gpus, args.prefill_gpus, args.decode_gpus,
                         args.prefill_workers.min, args.decode_workers.min)
    args.mode = choice.mode
    if args.worker_threads is None:
        args.worker_threads = default_worker_threads(args.mode, nodes, args.decode_workers.min)
    _say(f"mode: {args.mode} ({choice.reason}); {args.worker_threads} torch thread(s) per worker")
    engine = EngineArgs(model=str(info.model_dir), dtype=args.dtype, max_model_len=max_model_len,
                        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_step_ms=args.max_step_ms,
                        num_threads=args.worker_threads, chat_template=chat_template,
                        attention_backend=args.attention_backend, device=args.device,
                        served_model_name=args.served_model_name or args.model)
    sizes = {Role.DECODE: args.decode_workers}
    if args.mode == "disagg":
        sizes[Role.PREFILL] = args.prefill_workers
    _say("workers: " + ", ".join(
        f"{role} {'on ' + format(gpus, 'g') + ' GPU each' if gpus else 'on the CPU'}"
        for role, gpus in ((Role.PREFILL, args.prefill_gpus), (Role.DECODE, args.decode_gpus)) if role in sizes))
    secret = os.environ.get("TANDEM_CLUSTER_SECRET") or secrets.token_urlsafe(32)
    handles: dict = {}  # address -> every worker launched, whatever happens next, so that all are stopped
    from cluster.actors import WorkerStartupError
    from cluster.redis_server import PrivateRedis

    private_redis = None
    if not args.redis_url:
        private_redis = PrivateRedis()
        args.redis_url = private_redis.start()
        _say(f"prefix index: private Redis on 127.0.0.1:{private_redis.port}")
    try:
        return _serve(args, info, engine, max_model_len, sizes, policy, secret, handles)
    except WorkerStartupError as exc:
        _say(f"error: {exc}")
        return 1
    finally:
        for handle in handles.values():
            ray.kill(handle.actor, no_restart=True)
        if started_ray:
            ray.shutdown()
        if private_redis is not None:
            private_redis.close()
        _say("stopped")


class _Workers:
    """Starts and stops this command's workers (blocking calls: run them in threads). Every
    worker started is in ``handles`` (address -> WorkerHandle) until it is stopped, so that
    shutdown stops them all."""

    def __init__(self, engine, args, secret: str, handles: dict) -> None:
        from cluster.actors import Placement
        from decode_worker.worker import DecodeWorkerConfig
        from prefill_worker.worker import PrefillWorkerConfig
        from prefix_index.publisher import PrefixIndexConfig
        from worker_runtime.server import ServerConfig

        server = ServerConfig("", args.worker_port, secret)
        index = PrefixIndexConfig(args.redis_url)
        placement = Placement(ready_timeout_s=args.ready_timeout)
        self.configs = {
            Role.PREFILL: PrefillWorkerConfig(engine, server, prefix_index=index, tracing=args.tracing),
            Role.DECODE: DecodeWorkerConfig(engine, server, prefix_index=index, tracing=args.tracing,
                                         kv_failure_policy=KVFailurePolicy(args.kv_failure_policy)),
        }
        self.placements = {Role.PREFILL: replace(placement, nice=max(0, args.prefill_nice), num_gpus=args.prefill_gpus),
                           Role.DECODE: replace(placement, num_gpus=args.decode_gpus)}
        self.handles = handles

    def start(self, role: str) -> str:
        """One worker, once it serves: its address."""
        from cluster.actors import launch_worker

        handle = launch_worker(role, self.configs[role], self.placements[role])
        self.handles[handle.address] = handle
        return handle.address

    def stop(self, address: str, timeout_s: float = 30.0) -> None:
        import ray

        handle = self.handles[address]
        try:
            ray.get(handle.actor.stop.remote(), timeout=timeout_s)
        except Exception as exc:  # it is killed next either way
            _say(f"{handle.role} worker {handle.address} did not stop cleanly: {exc}")
        ray.kill(handle.actor, no_restart=True)
        del self.handles[address]

    def launch(self, counts: dict[str, int], threads: int) -> None:
        """Start the pools in parallel (blocking); then raise the first failure, if any."""
        _say(f"starting {counts.get('prefill', 0)} prefill and {counts['decode']} decode workers "
             f"({threads} threads each)")
        began = time.monotonic()
        roles = [role for role, count in counts.items() for _ in range(count)]
        with ThreadPoolExecutor(len(roles)) as pool:
            pending = [pool.submit(self.start, role) for role in roles]
        errors = [future.exception() for future in pending if future.exception() is not None]
        for handle in self.handles.values():
            _say(f"{handle.role} worker ready at {handle.address}")
        if errors:
            raise errors[0]
        _say(f"workers ready in {time.monotonic() - began:.1f} s")


def _serve(args, info, engine, max_model_len: int, sizes: dict[str, PoolSize], policy, secret: str,
           handles: dict) -> int:
    """HTTP and gRPC come up first (not ready: /ready 503, health NOT_SERVING), then the
    workers start; the server turns ready when they are."""
    import uvicorn

    from cluster.autoscale import PoolAutoscaler, ScaleRule
    from prefix_index.reader import PrefixIndex
    from router.app import build_app
    from router.grpc_api import PublicGrpcServer
    from router.limits import RequestLimits
    from router.state import RouterConfig, RouterState
    from router.workers import WorkerPool
    from telemetry.tracing import ROUTER_SERVICE, setup_tracing

    limits = RequestLimits(max_n=args.max_n, max_prompts=args.max_prompts_per_request, max_stop=args.max_stop_strings,
                           max_stop_len=args.max_stop_string_len, max_input_chars=args.max_input_chars)
    config = RouterConfig(served_model_name=args.served_model_name or args.model, max_model_len=max_model_len,
                          api_key=args.api_key, max_queue=args.max_queue, limits=limits,
                          tokenizer_threads=args.tokenizer_threads, kv_transport=_TRANSPORTS[args.kv_transport],
                          drain_timeout_s=args.drain_timeout, local_prefill_max_tokens=args.local_prefill_max_tokens)
    pool = WorkerPool([], [], secret, policy)
    index = PrefixIndex(args.redis_url) if args.routing_policy == "prefix" else None
    tracing = setup_tracing(ROUTER_SERVICE, args.tracing, f"{args.host}:{args.port}")
    state = RouterState(config, info, pool, index, tracing)
    workers = _Workers(engine, args, secret, handles)
    rules = {Role.PREFILL: ScaleRule(args.prefill_queue_target, args.scale_up_window, args.scale_down_window),
             Role.DECODE: ScaleRule(args.decode_queue_target, args.scale_up_window, args.scale_down_window)}
    autoscaler = PoolAutoscaler(pool, sizes, rules, workers.start, workers.stop, args.autoscale_interval,
                                args.drain_timeout)
    state.registry.register(autoscaler)
    tls = None
    if args.grpc_tls_cert or args.grpc_tls_key:
        if not (args.grpc_tls_cert and args.grpc_tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        tls = (open(args.grpc_tls_cert, "rb").read(), open(args.grpc_tls_key, "rb").read())
    public_grpc: PublicGrpcServer | None = None  # made on the serving loop (grpc.aio binds to it)

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if state.draining:  # a second signal: stop now
                return super().handle_exit(sig, frame)
            _say("draining: no new requests; waiting for those in flight")
            state.draining = True
            loop = asyncio.get_running_loop()
            loop.create_task(public_grpc.set_serving(False))
            loop.create_task(autoscaler.stop())  # the pools stay as they are while draining
            loop.create_task(_drain(self, state))

    async def main() -> None:
        nonlocal public_grpc
        sweeping = None
        public_grpc = PublicGrpcServer(state, args.host, args.grpc_port, tls)
        await public_grpc.start(serving=False)
        server = DrainingServer(uvicorn.Config(build_app(state), host=args.host, port=args.port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        serving = asyncio.create_task(server.serve())
        while not server.started and not serving.done():
            await asyncio.sleep(0.05)
        try:
            if server.started:
                _say(f"listening on http://{args.host}:{args.port} and grpc {args.host}:{public_grpc.port}; "
                     "not ready until the workers are")
                counts = {role: size.min for role, size in sizes.items()}
                launch = asyncio.get_running_loop().run_in_executor(None, workers.launch, counts, args.worker_threads)
                await asyncio.wait({launch, serving}, return_when=asyncio.FIRST_COMPLETED)
                if launch.done():
                    launch.result()  # a worker that did not start stops everything, with its error
                    for role in sizes:
                        pool.add_workers(role, [h.address for h in handles.values() if h.role == role])
                    await pool.start()
                    if any(size.autoscaled for size in sizes.values()):
                        await autoscaler.start()
                        _say("autoscaling: " + ", ".join(f"{role} {size}" for role, size in sizes.items()))
                    if index is not None:
                        await index.start()
                        sweeping = asyncio.create_task(_sweep_forever(index, pool))
                    if not state.draining:
                        await public_grpc.set_serving(True)
                        _say(f"ready: http://{args.host}:{args.port}/v1 and grpc {args.host}:{public_grpc.port} "
                             f"serving {config.served_model_name} ({args.mode})")
            await serving
        finally:
            if not serving.done():
                server.should_exit = True
                await serving
            await public_grpc.stop()
            await autoscaler.stop()
            await pool.stop()
            if sweeping is not None:
                sweeping.cancel()
            if index is not None:
                await index.close()

    try:
        asyncio.run(main())
    finally:
        if tracing is not None:
            tracing.shutdown()  # exports what is still batched
    return 0
async def _sweep_forever(index, pool, every_s: float = 30.0) -> None:
    """Delete the index entries of worker incarnations whose heartbeat expired."""
    while True:
        await asyncio.sleep(every_s)
        reference = next((w.stats for w in pool.decode + pool.prefill if w.stats and w.stats.prefix_incarnation), None)
        if reference is not None:
            try:
                await index.sweep_dead(reference.prefix_namespace)
            except Exception as exc:  # the index is best effort: never take the server down
                logging.getLogger(__name__).warning("prefix index sweep failed: %s", exc)


async def _drain(server, state) -> None:
    deadline = time.monotonic() + state.config.drain_timeout_s
    while state.num_in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    if state.num_in_flight:
        _say(f"drain timeout: aborting {state.num_in_flight} requests")
        await state.dispatcher.abort_all()
        settle = time.monotonic() + 10
        while state.num_in_flight and time.monotonic() < settle:
            await asyncio.sleep(0.05)
    server.should_exit = True
