"""`tandem bench router`: the per-token latency the HTTP gateway adds over calling the decode
worker's gRPC stream directly, measured in the same run at each concurrency.

One decode worker (colocated, real gRPC) serves both paths. For each
concurrency c, c streams of the same shape run at once, first straight over gRPC, then
through the router (uvicorn + FastAPI + SSE, real HTTP on loopback); the inter-token latency
of a stream is the mean gap between its chunk arrivals after the first. The worker, the router
and the clients run in separate processes, as they are deployed."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import socket
import statistics
import time
from dataclasses import dataclass

import grpc
import httpx

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from proto.rpc import CHANNEL_OPTIONS, secret_metadata
from worker_runtime.server import ServerConfig

SECRET = "bench-secret"
MODEL_NAME = "bench-model"


@dataclass(frozen=True, slots=True)
class RouterRow:
    concurrency: int
    grpc_itl_ms: float  # median over rounds of the mean over streams of each stream's mean gap
    http_itl_ms: float

    @property
    def overhead_ms(self) -> float:
        return self.http_itl_ms - self.grpc_itl_ms


def _itl_ms(arrivals: list[float]) -> float:
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return 1000 * statistics.mean(gaps)


async def _grpc_streams(address: str, concurrency: int, prompt: list[int], max_tokens: int) -> float:
    from engine import SamplingParams

    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)

        async def one(index: int) -> float:
            request = pb.GenerateRequest(request_id=f"g{concurrency}-{index}-{time.monotonic_ns()}",
                                         prompt_token_ids=prompt, params=params)
            arrivals = [time.perf_counter() async for _ in stub.Generate(request, metadata=secret_metadata(SECRET))]
            return _itl_ms(arrivals)

        return statistics.mean(await asyncio.gather(*(one(i) for i in range(concurrency))))


async def _http_streams(base_url: str, concurrency: int, prompt: list[int], max_tokens: int) -> float:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:

        async def one() -> float:
            arrivals = []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        arrivals.append(time.perf_counter())
            return _itl_ms(arrivals)

        return statistics.mean(await asyncio.gather(*(one() for _ in range(concurrency))))


def _run_decode_worker(model: str, threads: int, max_num_seqs: int, ready, stop) -> None:
    """Child process: one colocated decode worker until ``stop`` is set."""
    from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from engine.llm import EngineArgs

    engine = EngineArgs(model=model, dtype="float32", max_model_len=512, num_threads=threads,
                        max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    worker = DecodeWorker(DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET)))
    ready.put(worker.start())
    stop.wait(3600)
    worker.stop()


def _run_router(model: str, decode_address: str, port: int, ready, stop) -> None:
    """Child process: the gateway in front of ``decode_address`` until ``stop`` is set."""
    import uvicorn

    from engine.model_info import load_model_info
    from router.app import build_app
    from router.policy import LoadPolicy
    from router.state import RouterConfig, RouterState
    from router.workers import WorkerPool

    pool = WorkerPool([decode_address], [], SECRET, LoadPolicy())
    state = RouterState(RouterConfig(MODEL_NAME, 512, max_queue=1024), load_model_info(model), pool)
    server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=port, log_level="warning"))

    async def main() -> None:
        await pool.start()
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        ready.put(f"http://127.0.0.1:{port}")
        while not stop.is_set():
            await asyncio.sleep(0.1)
        server.should_exit = True
        await serving
        await pool.stop()

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def router_overhead(model: str, concurrencies: list[int], max_tokens: int, threads: int,
                    rounds: int = 3) -> list[RouterRow]:
    """The worker, the router and these clients each in their own process, as deployed."""
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Queue(), context.Event()
    processes = [context.Process(target=_run_decode_worker, args=(model, threads, max(concurrencies), ready, stop))]
    processes[0].start()
    prompt = list(range(1000, 1032))
    rows = []
    try:
        address = ready.get(timeout=300)
        processes.append(context.Process(target=_run_router, args=(model, address, _free_port(), ready, stop)))
        processes[1].start()
        base_url = ready.get(timeout=120)
        asyncio.run(_grpc_streams(address, 1, prompt, 8))  # warm-up, both paths
        asyncio.run(_http_streams(base_url, 1, prompt, 8))
        for concurrency in concurrencies:
            grpc_ms, http_ms = [], []
            for _ in range(rounds):  # alternated, so drifts of the machine hit both paths alike
                grpc_ms.append(asyncio.run(_grpc_streams(address, concurrency, prompt, max_tokens)))
                http_ms.append(asyncio.run(_http_streams(base_url, concurrency, prompt, max_tokens)))
            rows.append(RouterRow(concurrency, statistics.median(grpc_ms), statistics.median(http_ms)))
    finally:
        stop.set()
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
    return rows


def render_router(rows: list[RouterRow], threads: int, max_tokens: int) -> str:
    lines = [f"decode worker: {threads} torch threads; {max_tokens} tokens per stream; median of alternated rounds; "
             "worker, router and clients in separate processes on this machine",
             "", "| streams | direct gRPC ms/token | through the router ms/token | router adds ms/token |",
             "|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row.concurrency} | {row.grpc_itl_ms:.2f} | {row.http_itl_ms:.2f} | {row.overhead_ms:+.2f} |")
    return "\n".join(lines)


def register(commands, default_model: str) -> None:
    router = commands.add_parser("router", help="per-token latency the HTTP gateway adds over direct gRPC")
    router.add_argument("--model", default=default_model)
    router.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    router.add_argument("--max-tokens", type=int, default=64)
    router.add_argument("--threads", type=int, default=1, help="the decode worker's torch threads")
    router.add_argument("--rounds", type=int, default=3)
    router.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from bench.report import comma_ints

    rows = router_overhead(args.model, list(comma_ints(args.concurrency)), args.max_tokens, args.threads,
                           args.rounds)
    print(render_router(rows, args.threads, args.max_tokens))
    return 0
