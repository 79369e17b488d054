"""The prefix-cache index against a real Redis server (a private one per module): what the
workers publish follows their caches, dead incarnations stop counting, other block sizes
never match."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time

import pytest
import redis

from cluster.redis_server import PrivateRedis
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.kv_cache.block_hash import hash_blocks, namespace_digest
from engine.llm import EngineArgs
from prefix_index.keys import WorkerKeys
from prefix_index.publisher import PrefixIndexConfig
from prefix_index.reader import PrefixIndex
from proto import worker_pb2 as pb
from router.policy import WorkerView
from tests.workers import SECRET, generate, generate_request, wait_until
from worker_runtime.server import ServerConfig


@pytest.fixture(scope="module")
def private_redis():
    server = PrivateRedis()
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def publishing_worker(private_redis, smollm_dir):
    engine = EngineArgs(model=str(smollm_dir), dtype="float32", num_kv_blocks=40, max_model_len=512, num_threads=1)
    config = DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET),
                                prefix_index=PrefixIndexConfig(private_redis.url, heartbeat_ttl_s=2.0))
    worker = DecodeWorker(config)
    worker.start()
    wait_until(worker.runtime.publisher.connected.is_set, what="the publisher to connect")
    yield worker
    worker.stop()


def held_in_redis(private_redis, worker) -> set[bytes]:
    client = redis.Redis.from_url(private_redis.url)
    return client.smembers(WorkerKeys.of(worker.core.kv_manager.namespace, worker.address, worker.runtime.publisher.incarnation).blocks)


def lookup(url: str, namespace: bytes, digests: list[bytes], views: list[WorkerView]) -> dict[str, int] | None:
    async def run():
        index = PrefixIndex(url, budget_s=1.0)
        await index.start()
        try:
            incarnations = {v.address: v.stats.prefix_incarnation if v.stats is not None else "" for v in views}
            return await index.leading_blocks(namespace, digests, incarnations)
        finally:
            await index.close()

    return asyncio.run(run())


def test_published_blocks_follow_inserts_and_evictions(private_redis, publishing_worker, llm):
    worker = publishing_worker
    tokenizer = llm.get_tokenizer()
    prompt = tokenizer.encode("[index] A long shared system prompt about oceans, rivers and lakes. " * 4)
    generate(worker.address, generate_request("warm", prompt, SamplingParams(temperature=0.0, max_tokens=2)))
    namespace, block_size = worker.core.kv_manager.namespace, worker.core.kv_manager.block_size
    digests = hash_blocks(namespace, prompt, block_size)
    assert len(digests) >= 3
    wait_until(lambda: set(digests) <= held_in_redis(private_redis, worker), what="the prompt's blocks in Redis")
    wait_until(lambda: held_in_redis(private_redis, worker) == set(worker.core.block_pool.cached_digests()),
               what="Redis to equal the engine's cache")

    view = WorkerView("decode", worker.address, healthy=True, stats=worker.stats())
    assert lookup(private_redis.url, namespace, digests, [view]) == {worker.address: len(digests)}
    other_size = namespace_digest(worker.core.config.model.served_model_name, 32, str(worker.core.config.model.dtype))
    other_digests = hash_blocks(other_size, prompt, 32)
    assert lookup(private_redis.url, other_size, other_digests, [view]) == {worker.address: 0}

    # other prompts fill the 40-block pool: the first prompt's blocks are evicted, and unpublished
    for index in range(6):
        filler = tokenizer.encode(f"[filler {index}] " + "Completely different words fill the cache here. " * 16)
        generate(worker.address, generate_request(f"fill-{index}", filler, SamplingParams(max_tokens=1)))
    assert not set(digests) & set(worker.core.block_pool.cached_digests())
    wait_until(lambda: not set(digests) & held_in_redis(private_redis, worker), what="evictions in Redis")
    wait_until(lambda: held_in_redis(private_redis, worker) == set(worker.core.block_pool.cached_digests()),
               what="Redis to equal the engine's cache")


def test_a_dead_workers_entries_stop_counting_after_its_ttl(private_redis):
    """A publisher in a process killed with SIGKILL (no goodbye): its entries count until its
    heartbeat expires, then not at all, and the sweep deletes them."""
    namespace = namespace_digest("ttl-model", 16, "torch.float32")
    digests = hash_blocks(namespace, list(range(64)), 16)
    script = textwrap.dedent(f"""
        import sys, time
        from prefix_index.publisher import PrefixEventPublisher, PrefixIndexConfig
        digests = [bytes.fromhex(h) for h in {[d.hex() for d in digests]!r}]
        publisher = PrefixEventPublisher(PrefixIndexConfig({private_redis.url!r}, heartbeat_ttl_s=1.5),
                                         bytes.fromhex({namespace.hex()!r}), "doomed:1", lambda: digests)
        publisher.start()
        publisher.connected.wait(10)
        print(publisher.incarnation, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        incarnation = child.stdout.readline().strip()
        assert incarnation
        view = WorkerView("prefill", "doomed:1", healthy=True, stats=pb.WorkerStats(prefix_incarnation=incarnation))
        assert lookup(private_redis.url, namespace, digests, [view]) == {"doomed:1": 4}
    finally:
        child.kill()
        child.wait(10)
    wait_until(lambda: lookup(private_redis.url, namespace, digests, [view]) == {"doomed:1": 0}, timeout_s=10,
               what="the dead incarnation to stop counting")

    async def sweep():
        index = PrefixIndex(private_redis.url)
        try:
            return await index.sweep_dead(namespace)
        finally:
            await index.close()

    assert asyncio.run(sweep()) >= 1
    assert not redis.Redis.from_url(private_redis.url).exists(WorkerKeys.of(namespace, "doomed:1", incarnation).blocks)


def test_routing_follows_the_index_and_survives_a_redis_outage(smollm_dir, llm):
    """Two colocated decode workers. A prompt is warmed on one of them directly (bypassing
    the router); requests sharing its prefix then go there. Redis stops: requests still
    succeed. A prompt warmed during the outage is in no event stream; once Redis is back the
    worker's full republish puts it in the index, and routing follows it again."""
    import httpx

    from tests.router.conftest import start_server

    redis_server = PrivateRedis()
    redis_server.start()
    server = start_server(smollm_dir, "colocated", "--decode-workers", "2", "--redis-url", redis_server.url,
                          env={"TANDEM_CLUSTER_SECRET": SECRET})
    tokenizer = llm.get_tokenizer()
    try:
        metrics = lambda: httpx.get(f"{server.base_url}/metrics", timeout=10).text  # noqa: E731
        addresses = sorted(set(line.split('address="')[1].split('"')[0] for line in metrics().splitlines()
                               if line.startswith('tandem:worker_healthy{') and 'role="decode"' in line))
        assert len(addresses) == 2
        warm = addresses[-1]  # the one load and round-robin would not both pick first

        def routed_usage(shared: list[int], suffix: str) -> dict:
            body = {"model": "smollm2-135m-instruct", "prompt": shared + tokenizer.encode(suffix), "max_tokens": 1,
                    "temperature": 0}
            response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["usage"]

        def routed_cached_tokens(shared: list[int], suffix: str) -> int:
            return routed_usage(shared, suffix)["prompt_tokens_details"]["cached_tokens"]

        def warm_directly(text: str) -> list[int]:
            shared = tokenizer.encode(text)
            generate(warm, generate_request(f"direct-{len(text)}", shared, SamplingParams(max_tokens=1)))
            return shared

        def indexed(shared: list[int]) -> bool:
            client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
            digests = hash_blocks(namespace_digest("smollm2-135m-instruct", 16, "torch.float32"), shared, 16)
            keys = [k for k in client.scan_iter(match=f"*:blocks:{warm}:*")]
            return bool(keys) and all(client.sismember(keys[0], d) for d in digests)

        first = warm_directly("[route] You are a meticulous assistant for a shipping company. " * 3)
        wait_until(lambda: indexed(first), what="the warmed blocks in the index")
        time.sleep(1.0)  # a Stats poll after the warm-up, so the counters below start from it
        computed_before = server.metric("num_prompt_tokens_computed", "decode")
        usage = []
        for turn in range(3):
            usage.append(routed_usage(first, f" Question {turn}: where is my parcel?"))
            assert usage[-1]["prompt_tokens_details"]["cached_tokens"] >= len(first) // 16 * 16
        # cached_tokens adds up: prompt tokens not computed on the decode workers are exactly those reported
        expected = sum(u["prompt_tokens"] for u in usage) - sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
        wait_until(lambda: server.metric("num_prompt_tokens_computed", "decode") - computed_before == expected,
                   what="the workers' counters to match usage")

        redis_server.stop()  # the index goes away mid-test
        for turn in range(2):
            routed_cached_tokens(first, f" Outage question {turn}?")  # still answered
        second = warm_directly("[outage] Translate every sentence into formal French, carefully. " * 3)
        redis_server.start()  # back, empty: only the workers' republish can fill it
        wait_until(lambda: indexed(second), timeout_s=30, what="the index rebuilt from the workers")
        wait_until(lambda: routed_cached_tokens(second, " Bonjour?") >= len(second) // 16 * 16, timeout_s=30,
                   what="prefix-aware routing again")
    finally:
        server.stop()
        redis_server.close()


SYSTEM_PROMPTS = [
    "You are a customer-support agent for an airline. Be polite, brief, and quote the fare rules exactly. " * 3,
    "You are a cooking assistant. Give metric quantities, oven temperatures in Celsius, and safety notes. " * 3,
    "You are a legal research helper. Cite the statute, never give advice, and flag uncertainty clearly. " * 3,
    "You are a tutor for high-school physics. Explain with one formula and one everyday example each time. " * 3,
]


def run_shared_prefix_workload(model_dir, policy: str, llm) -> tuple[float, list[str], int]:
    """4 system prompts x 3 user turns in a fixed shuffled order, on 2 prefill workers and one
    decode worker; returns (prefill hit rate, the outputs, summed usage cached_tokens)."""
    import random

    import httpx

    from tests.router.conftest import start_server

    order = [(p, t) for p in range(4) for t in range(3)]
    random.Random(5).shuffle(order)
    server = start_server(model_dir, "disagg", "--prefill-workers", "2", "--routing-policy", policy,
                          "--local-prefill-max-tokens", "0")
    try:
        texts, cached, prompt_tokens = [], 0, 0
        for prompt_index, turn in order:
            body = {"model": "smollm2-135m-instruct", "max_tokens": 4, "temperature": 0,
                    "prompt": SYSTEM_PROMPTS[prompt_index] + f"\nUser question {turn}: what should I do first?"}
            answer = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120).json()
            texts.append(answer["choices"][0]["text"])
            cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt_tokens += answer["usage"]["prompt_tokens"]
        wait_until(lambda: server.metric("num_running", "prefill") == 0, what="prefill workers idle")
        time.sleep(1.0)  # one more Stats poll
        computed = server.metric("num_prompt_tokens_computed", "prefill")
        return 1 - computed / prompt_tokens, texts, cached
    finally:
        server.stop()


def test_prefix_routing_beats_round_robin_on_shared_prefixes(smollm_dir, llm):
    prefix_rate, prefix_texts, prefix_cached = run_shared_prefix_workload(smollm_dir, "prefix", llm)
    rr_rate, rr_texts, _ = run_shared_prefix_workload(smollm_dir, "round-robin", llm)
    print(f"prefill prefix-hit rate: prefix routing {prefix_rate:.2f}, round-robin {rr_rate:.2f}")
    assert prefix_rate >= 1.5 * rr_rate and prefix_rate > 0.3
    assert prefix_texts == rr_texts  # routing changes where, never what
    assert prefix_cached > 0
