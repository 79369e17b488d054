"""Dispatch against a real decode worker (in this process, real gRPC) and a dead address:
a sequence that fails before its first token is retried once elsewhere; the load policy
picks by its formula."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from bench.launch import free_port
from engine import SamplingParams
from proto import worker_pb2 as pb
from proto.convert import params_to_proto
from router.dispatch import Dispatcher, Sequence
from router.errors import APIError
from router.policy import (
    PREFILL_RATE_DEFAULT,
    LoadPolicy,
    RoundRobinPolicy,
    RouteRequest,
    WorkerView,
    make_policy,
    unmeasured_prefill_rate,
)
from router.workers import WorkerPool
from tests.workers import SECRET, wait_all_free


@pytest.fixture(scope="module")
def decode_worker(smollm_decode_worker):
    return smollm_decode_worker


def healthy_pool(decode_addresses: list[str]) -> WorkerPool:
    pool = WorkerPool(decode_addresses, [], SECRET, RoundRobinPolicy())
    for worker in pool.decode:
        worker.healthy = True  # as if their last Stats had answered
    return pool


def run_sequence(pool: WorkerPool, prompt_ids: list[int]) -> list[int]:
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sequence = Sequence(0, 0, pb.GenerateRequest(request_id="retry-me", prompt_token_ids=prompt_ids, params=params))

    async def collect():
        tokens = [t async for chunk in Dispatcher(pool, pb.KV_TRANSPORT_GRPC).stream(sequence) for t in chunk.token_ids]
        await pool.stop()
        return tokens

    return asyncio.run(collect())


def test_failure_before_first_token_is_retried_on_another_worker(decode_worker, llm):
    dead = f"127.0.0.1:{free_port()}"
    pool = healthy_pool([dead, decode_worker.address])  # round-robin tries the dead one first
    ids = llm.get_tokenizer().encode("The sea is")
    tokens = run_sequence(pool, ids)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert tokens == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    stats = decode_worker.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks


def test_two_failures_give_a_503(llm):
    pool = healthy_pool([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    with pytest.raises(APIError) as info:
        run_sequence(pool, [1, 2, 3])
    assert info.value.status == 503


def test_load_policy_follows_its_formula():
    def view(address, running, free, in_flight=0):
        stats = pb.WorkerStats(num_running=running, num_free_kv_blocks=free, num_kv_blocks=100)
        return WorkerView("decode", address, healthy=True, stats=stats, in_flight=in_flight)

    busy, idle, full = view("a:1", 8, 90), view("b:1", 1, 90), view("c:1", 0, 1, in_flight=3)
    assert LoadPolicy().pick([busy, idle, full]) is idle
    idle.healthy = False
    assert LoadPolicy().pick([busy, idle, full]) is busy  # 8/90 < 3/1
    prefill = [WorkerView("prefill", "p:1", True, pb.WorkerStats(), prompt_tokens_in_flight=500),
               WorkerView("prefill", "p:2", True, pb.WorkerStats(num_waiting=2), prompt_tokens_in_flight=100)]
    assert LoadPolicy().pick(prefill).address == "p:2"
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")


def test_prefix_policy_follows_its_formula():
    def decode(address, running=0, free=100, hit=0):
        stats = pb.WorkerStats(num_running=running, num_free_kv_blocks=free, num_kv_blocks=100)
        return WorkerView("decode", address, healthy=True, stats=stats), hit

    policy = make_policy("prefix")
    (cold, _), (warm, _) = decode("a:1"), decode("b:1", running=1)
    route = RouteRequest(100, {"a:1": 0, "b:1": 80})
    assert policy.pick([cold, warm], route) is warm  # 2*0.2 + 1/9 < 2*1
    warm.stats.num_running, warm.stats.num_free_kv_blocks = 40, 2
    assert policy.pick([cold, warm], route) is cold  # full and busy: 0.4 + 0.83 + 0.98 > 2
    assert policy.pick([cold, warm], RouteRequest(100, None)) is cold  # no index: by load
    fast, slow = (WorkerView("prefill", "p:1", True, pb.WorkerStats(), prompt_tokens_in_flight=0, prefill_rate=4000),
                  WorkerView("prefill", "p:2", True, pb.WorkerStats(), prompt_tokens_in_flight=0, prefill_rate=1000))
    assert policy.pick([fast, slow], RouteRequest(1000, {"p:1": 0, "p:2": 900})) is slow  # 100/1000 < 1000/4000
    assert policy.pick([fast, slow], RouteRequest(1000, {"p:1": 0, "p:2": 0})) is fast


def test_an_unmeasured_prefill_worker_is_expected_to_be_as_fast_as_its_measured_peers():
    policy = make_policy("prefix")
    measured = WorkerView("prefill", "p:1", True, pb.WorkerStats(), prefill_rate=300)
    new = WorkerView("prefill", "p:2", True, pb.WorkerStats())
    assert unmeasured_prefill_rate([measured, new]) == 300 and unmeasured_prefill_rate([new]) == PREFILL_RATE_DEFAULT
    # the cached prefix decides between them: 76 - 64 tokens at 300/s beat 76 at 300/s (with
    # PREFILL_RATE_DEFAULT for the new worker, 76/2000 s would win and miss the cache)
    assert policy.pick([measured, new], RouteRequest(76, {"p:1": 64, "p:2": 0})) is measured


def test_the_prefill_rate_is_measured_over_busy_time_not_the_poll_s_wall_time():
    pool = WorkerPool([], ["p:1", "p:2"], SECRET, make_policy("prefix"))
    steps, old = pool.prefill

    def poll(worker, now, tokens, prompt_ms=0.0, decode_ms=0.0, lane_ms=0):
        stats = pb.WorkerStats(num_prompt_tokens_computed=tokens, prompt_steps_ms=prompt_ms,
                               decode_steps_ms=decode_ms, lane_busy_ms=lane_ms)
        pool._measure_rate(worker, stats, now)

    poll(steps, 10.0, 0)
    poll(steps, 10.5, 100, prompt_ms=40.0, decode_ms=5.0, lane_ms=5)  # 100 tokens in 50 ms of a 500 ms poll
    assert steps.prefill_rate == pytest.approx(2000)
    poll(steps, 11.0, 100, prompt_ms=40.0, decode_ms=30.0)  # decoding only: no sample
    assert steps.prefill_rate == pytest.approx(2000)
    poll(steps, 11.5, 200, prompt_ms=65.0, decode_ms=30.0)  # 100 more in 25 ms: 4000/s, averaged in
    assert steps.prefill_rate == pytest.approx(0.7 * 2000 + 0.3 * 4000)
    poll(old, 10.0, 0)
    poll(old, 10.5, 100)  # a worker that reports no step times: over the wall time
    assert old.prefill_rate == pytest.approx(200)


def test_short_prompts_skip_the_prefill_worker(decode_worker, llm):
    """--local-prefill-max-tokens: the prefill worker here is a dead address, so only a
    request that really skips it can succeed."""
    pool = healthy_pool([decode_worker.address])
    pool.prefill = [WorkerView("prefill", f"127.0.0.1:{free_port()}", healthy=True)]
    ids = llm.get_tokenizer().encode("Short prompt")
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    sequence = Sequence(0, 0, pb.GenerateRequest(request_id="short", prompt_token_ids=ids, params=params,
                                                 kv_failure_policy=pb.KV_FAILURE_POLICY_FAIL))

    async def collect():
        dispatcher = Dispatcher(pool, pb.KV_TRANSPORT_GRPC, local_prefill_max_tokens=len(ids))
        tokens = [t async for chunk in dispatcher.stream(sequence) for t in chunk.token_ids]
        await pool.stop()
        return tokens

    assert len(asyncio.run(collect())) == 2


def test_the_decode_worker_refuses_what_it_cannot_take_and_names_the_field(decode_worker):
    """Behind the router's checks, the worker's own: a 70 KB id (it would not fit a KV frame's
    header) and a stop id past the vocabulary are INVALID_ARGUMENT with the field in the
    trailing metadata, and nothing is held."""
    from tests.workers import METADATA, decode_stub, generate_request

    stub = decode_stub(decode_worker.address)
    cases = [(generate_request("r" * 70_000, [1, 2, 3], SamplingParams(max_tokens=2)), "request_id"),
             (generate_request("stop-id", [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2,
                                                                   stop_token_ids=[49152])), "stop_token_ids")]
    for request, param in cases:
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request, metadata=METADATA, timeout=30))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert dict(info.value.trailing_metadata())["tandem-error-param"] == param
    stats = decode_worker.stats()
    assert stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_waiting == stats.num_running == 0


def test_a_request_s_own_error_is_not_retried():
    """A worker that says the error was the request's own (tandem-error-scope: request) is not
    asked again, and neither is another: the client gets a 500. Any other INTERNAL is retried."""
    from router.dispatch import _is_own_fault

    class Failed(grpc.aio.AioRpcError):
        def __init__(self, trailer):
            super().__init__(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(*trailer), "boom")

    assert _is_own_fault(Failed([("tandem-error-scope", "request")]))
    assert not _is_own_fault(Failed([("tandem-error-scope", "step")]))
    assert not _is_own_fault(Failed([]))


def pool_with_prefill(decode_address: str, prefill_address: str, prefill_healthy: bool = True) -> WorkerPool:
    pool = WorkerPool([decode_address], [prefill_address], SECRET, RoundRobinPolicy())
    pool.decode[0].healthy = True
    pool.prefill[0].healthy = prefill_healthy  # as their last Stats said
    return pool


def run_with_decisions(pool: WorkerPool, prompt_ids: list[int], policy=pb.KV_FAILURE_POLICY_FAIL):
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    request = pb.GenerateRequest(request_id="fallback", prompt_token_ids=prompt_ids, params=params,
                                 kv_failure_policy=policy)
    decisions = []

    async def collect():
        dispatcher = Dispatcher(pool, pb.KV_TRANSPORT_GRPC, on_decision=decisions.append)
        tokens = [t async for chunk in dispatcher.stream(Sequence(0, 0, request)) for t in chunk.token_ids]
        await pool.stop()
        return tokens

    return asyncio.run(collect()), decisions


def test_with_no_prefill_worker_serving_the_decode_worker_prefills_locally(decode_worker, llm):
    """DESIGN.md's failure rules: degraded, not down. The pool stays ready on its decode
    worker alone, and the request is counted as a local fallback."""
    ids = llm.get_tokenizer().encode("The river runs")
    pool = pool_with_prefill(decode_worker.address, f"127.0.0.1:{free_port()}", prefill_healthy=False)
    assert pool.is_ready
    computed_before = decode_worker.stats().num_prompt_tokens_computed
    tokens, decisions = run_with_decisions(pool, ids)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert tokens == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    assert decisions == ["local_fallback"]
    assert decode_worker.stats().num_prompt_tokens_computed - computed_before == len(ids)


def test_a_failed_transfer_is_retried_without_the_prefill_worker_only(decode_worker, llm):
    """The prefill worker is unreachable but still looks healthy (its polls have not failed
    yet): under the fail policy the decode worker fails the transfer; the retry excludes only
    the prefill worker, so the same decode worker serves it with a local prefill."""
    ids = llm.get_tokenizer().encode("A short walk in the hills")
    pool = pool_with_prefill(decode_worker.address, f"127.0.0.1:{free_port()}")
    tokens, decisions = run_with_decisions(pool, ids)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert tokens == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    assert decisions == ["remote", "retry", "local_fallback"]
    wait_all_free(decode_worker.stats)


def test_an_unreachable_decode_worker_leaves_routing_at_once(decode_worker, llm):
    dead = f"127.0.0.1:{free_port()}"
    pool = healthy_pool([dead, decode_worker.address])  # round-robin tries the dead one first
    run_sequence(pool, llm.get_tokenizer().encode("The sea is"))
    by_address = {w.address: w for w in pool.decode}
    assert not by_address[dead].healthy and by_address[dead].failures >= pool.failures_to_drop
    assert by_address[decode_worker.address].healthy


def test_a_request_past_its_deadline_ends_with_a_504_and_frees_the_worker(decode_worker):
    """--request-timeout defines "hung": past it the stream ends with a 504 and the decode
    worker drops the request (the gRPC call's own deadline cancels it there)."""
    pool = healthy_pool([decode_worker.address])
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
    sequence = Sequence(0, 0, pb.GenerateRequest(request_id="slow", prompt_token_ids=[1, 2, 3], params=params))
    received = []

    async def collect():
        dispatcher = Dispatcher(pool, pb.KV_TRANSPORT_GRPC, request_timeout_s=1.0)
        try:
            async for chunk in dispatcher.stream(sequence):
                received.extend(chunk.token_ids)
        finally:
            await pool.stop()

    with pytest.raises(APIError) as info:
        asyncio.run(collect())
    assert info.value.status == 504 and "--request-timeout" in info.value.message
    assert 0 < len(received) < 400  # it was streaming when the deadline came
    wait_all_free(decode_worker.stats)


def test_a_retry_waits_for_the_restarted_incarnation_of_the_only_decode_worker(decode_worker, llm):
    """The pool's only decode worker fails before the first token; a second later its
    restarted incarnation (a new address, as Ray's restart gives) joins: the retry goes there
    instead of ending in a 503."""
    dead = f"127.0.0.1:{free_port()}"
    pool = healthy_pool([dead])
    ids = llm.get_tokenizer().encode("The mountain path")
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    sequence = Sequence(0, 0, pb.GenerateRequest(request_id="restart", prompt_token_ids=ids, params=params))

    async def restart_later():
        await asyncio.sleep(1.0)
        view = pool.replace_worker(pool.decode[0], decode_worker.address)
        view.healthy = True  # as its first Stats would say

    async def collect():
        restarting = asyncio.create_task(restart_later())
        tokens = [t async for chunk in Dispatcher(pool, pb.KV_TRANSPORT_GRPC).stream(sequence) for t in chunk.token_ids]
        await restarting
        await pool.stop()
        return tokens

    tokens = asyncio.run(collect())
    reference = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert tokens == llm.generate({"prompt_token_ids": ids}, reference)[0].outputs[0].token_ids
    wait_all_free(decode_worker.stats)
