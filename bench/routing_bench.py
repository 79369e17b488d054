"""`tandem bench routing`: how long a prefix-aware routing decision takes: hashing the prompt's
blocks plus the one Redis round trip that yields every worker's leading hits, then the
policy's pick. Synthetic index entries for ``num_workers`` workers (that do not exist as
processes) in a private Redis; one of them holds most of the prompt."""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass

import redis

from engine.kv_cache.block_hash import hash_blocks, namespace_digest
from prefix_index.keys import WorkerKeys
from prefix_index.reader import PrefixIndex
from proto import worker_pb2 as pb
from router.dispatch import Dispatcher
from router.policy import PrefixPolicy
from router.workers import WorkerPool

BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class RoutingResult:
    """Every timed decision of one setting, and whether the policy picked the worker holding the prefix."""

    timings_ms: tuple[float, ...]  # sorted
    num_workers: int
    prompt_tokens: int
    chose_the_holder: bool

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.timings_ms)

    @property
    def p99_ms(self) -> float:
        return self.timings_ms[int(0.99 * (len(self.timings_ms) - 1))]


def routing_latency(num_workers: int = 16, prompt_tokens: int = 4096, rounds: int = 300) -> RoutingResult:
    from cluster.redis_server import PrivateRedis

    server = PrivateRedis()
    url = server.start()
    try:
        return asyncio.run(_measure(url, num_workers, prompt_tokens, rounds))
    finally:
        server.close()


async def _measure(url: str, num_workers: int, prompt_tokens: int, rounds: int) -> RoutingResult:
    namespace = namespace_digest("bench-model", BLOCK_SIZE, "torch.float32")
    prompt = [(i * 7919) % 50000 for i in range(prompt_tokens)]
    digests = hash_blocks(namespace, prompt, BLOCK_SIZE)
    client = redis.Redis.from_url(url)
    pool = WorkerPool([f"10.0.0.{i}:9000" for i in range(num_workers)], [], "unused", PrefixPolicy())
    for index, worker in enumerate(pool.decode):
        incarnation = f"inc{index}"
        worker.healthy = True
        worker.stats = pb.WorkerStats(num_kv_blocks=1000, num_free_kv_blocks=800, prefix_namespace=namespace,
                                      prefix_incarnation=incarnation, block_size=BLOCK_SIZE)
        held = digests[: len(digests) * 3 // 4] if index == num_workers // 2 else digests[: index % 3]
        other = hash_blocks(namespace_digest("bench-model", BLOCK_SIZE, f"noise{index}"), prompt[:2048], BLOCK_SIZE)
        keys = WorkerKeys.of(namespace, worker.address, incarnation)
        client.sadd(keys.blocks, *(held + other))
        client.set(keys.alive, 1, ex=600)
    index = PrefixIndex(url, budget_s=1.0)
    await index.start()
    dispatcher = Dispatcher(pool, pb.KV_TRANSPORT_GRPC, index=index)
    request = pb.GenerateRequest(request_id="bench", prompt_token_ids=prompt)
    timings, chosen = [], None
    for _ in range(rounds + 20):
        start = time.perf_counter()
        route = await dispatcher.route(request)
        chosen = pool.assign(frozenset(), route)
        timings.append((time.perf_counter() - start) * 1000)
    await index.close()
    return RoutingResult(tuple(sorted(timings[20:])), num_workers, prompt_tokens,  # the first 20 warm the connection
                         chosen.decode.address == pool.decode[num_workers // 2].address)


def render_routing(result: RoutingResult) -> str:
    return (f"prefix routing decision, {result.num_workers} workers, {result.prompt_tokens}-token prompt "
            f"(hash {result.prompt_tokens // BLOCK_SIZE} blocks + one Redis round trip + pick): "
            f"p50 {result.p50_ms:.2f} ms, p99 {result.p99_ms:.2f} ms (target p99 <= 2 ms); "
            f"picked the worker holding the prefix: {result.chose_the_holder}")


def register(commands, default_model: str) -> None:
    routing = commands.add_parser("routing", help="latency of a prefix-aware routing decision")
    routing.add_argument("--workers", type=int, default=16)
    routing.add_argument("--prompt-tokens", type=int, default=4096)
    routing.set_defaults(func=run_cli)


def run_cli(args) -> int:
    print(render_routing(routing_latency(args.workers, args.prompt_tokens)))
    return 0
