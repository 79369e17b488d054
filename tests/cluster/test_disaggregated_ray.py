"""Prefill and decode workers as real Ray actors, talking over real gRPC (and gloo): outputs
equal the offline engine's under DESIGN.md's token-equality rule, counters show where the
work happened, and failures (a stalled and killed prefill worker, aborts) leave no KV behind.

Requests use the `fail` policy unless a test is about `recompute`, so a silent local
fallback cannot hide a broken transfer."""

from __future__ import annotations

import concurrent.futures

import grpc
import pytest

import tests.cluster.kv_pause
from cluster.actors import Placement, WorkerStartupError, launch_worker
from decode_worker.worker import DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import EngineArgs
from prefill_worker.worker import PrefillWorkerConfig
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from tests.cluster.kv_pause import KVPause
from tests.conftest import make_llm
from tests.reference import EqualityStats, assert_same_as_engine_reference
from tests.workers import (
    METADATA,
    SECRET,
    collect,
    decode_stub,
    generate,
    generate_request,
    kv_bytes_per_token,
    wait_all_free,
    wait_until,
)
from worker_runtime.server import ServerConfig

PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog because",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3,
    "Explain, step by step, how photosynthesis converts light into chemical energy in plants. " * 8,
]


def launch_pair(model_dir, tag: str, kv_pause: KVPause):
    engine = EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=512, num_threads=1)
    server = ServerConfig("", 0, SECRET)  # each actor serves on its node's address
    prefill = launch_worker("prefill", PrefillWorkerConfig(engine, server, grpc_sink=kv_pause), name=f"prefill-{tag}")
    decode = launch_worker("decode", DecodeWorkerConfig(engine, server, kv_deadline_s=60), name=f"decode-{tag}")
    return prefill, decode


def running_pair(ray_cluster, model_dir, tag: str, kv_pause: KVPause):
    pair = launch_pair(model_dir, tag, kv_pause)
    yield pair
    for handle in pair:
        ray_cluster.kill(handle.actor, no_restart=True)


@pytest.fixture(scope="module")
def kv_pause(ray_cluster, tmp_path_factory) -> KVPause:
    """Holds the smollm prefill worker's next gRPC transfer mid-stream once armed."""
    ray_cluster.cloudpickle.register_pickle_by_value(tests.cluster.kv_pause)  # the actor gets the double's code
    return KVPause(str(tmp_path_factory.mktemp("kv-pause")))


@pytest.fixture(scope="module")
def smollm_pair(ray_cluster, smollm_dir, kv_pause):
    yield from running_pair(ray_cluster, smollm_dir, "smollm", kv_pause)


@pytest.fixture(scope="module")
def tiny_pair(ray_cluster, tiny_llama_dir, tmp_path_factory):
    yield from running_pair(ray_cluster, tiny_llama_dir, "tiny", KVPause(str(tmp_path_factory.mktemp("tiny-pause"))))


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    return make_llm(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, max_model_len=512)


def run_concurrently(decode_address: str, requests: list[pb.GenerateRequest]):
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: generate(decode_address, r), requests))


@pytest.mark.parametrize("model", ["smollm", "tiny"])
def test_disaggregated_greedy_equals_llm_generate(model, request):
    prefill, decode = request.getfixturevalue(f"{model}_pair")
    reference_llm = request.getfixturevalue("llm" if model == "smollm" else "tiny_llm")
    tokenizer = reference_llm.get_tokenizer()
    prompts = [f"[{model}] {p}" for p in PROMPTS]  # never seen by either worker's prefix cache
    ids = [tokenizer.encode(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = decode.stats(), prefill.stats()
    results = run_concurrently(decode.address, [
        generate_request(f"eq-{model}-{i}", prompt_ids, params, prefill.address) for i, prompt_ids in enumerate(ids)])
    after = decode.stats(), prefill.stats()

    reference = reference_llm.generate([{"prompt_token_ids": i} for i in ids], params.with_overrides(logprobs=2))
    stats = EqualityStats()
    for result, ref, prompt_ids in zip(results, reference, ids):
        assert_same_as_engine_reference(result.token_ids, ref.outputs[0], stats, label=f"{len(prompt_ids)} tokens")
        assert result.last.finish_reason == "length" and not result.last.kv_recomputed
    print(f"token-equality: {stats.compared} sequences, near-tie rule fired {stats.near_ties} times")
    assert stats.near_ties <= 1

    expected_bytes = sum(len(i) for i in ids) * kv_bytes_per_token(reference_llm.config.model.arch)
    assert after[0].kv_bytes_received - before[0].kv_bytes_received == expected_bytes
    assert after[1].kv_bytes_sent - before[1].kv_bytes_sent == expected_bytes
    assert after[0].num_prompt_tokens_computed == before[0].num_prompt_tokens_computed  # no local prefill
    assert after[1].num_prompt_tokens_computed - before[1].num_prompt_tokens_computed == sum(len(i) for i in ids)
    assert after[0].num_generation_tokens - before[0].num_generation_tokens == 12 * len(ids)
    assert after[0].num_kv_recomputed == before[0].num_kv_recomputed and after[0].num_kv_failed == 0
    wait_all_free(decode.stats)
    wait_all_free(prefill.stats)


def test_seeded_sampling_equals_colocated(smollm_pair, llm):
    prefill, decode = smollm_pair
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=10, ignore_eos=True)
    ids = [tokenizer.encode(f"[seeded] {p}") for p in PROMPTS[1:3]]
    results = run_concurrently(decode.address, [
        generate_request(f"seeded-{i}", prompt_ids, params, prefill.address) for i, prompt_ids in enumerate(ids)])
    colocated = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    assert [r.token_ids for r in results] == [c.outputs[0].token_ids for c in colocated]
    assert "".join(r.text for r in results)  # text deltas arrive with the tokens


def test_logprobs_stream_from_both_workers(smollm_pair, llm):
    """The first token's logprobs come from the prefill worker (with the KV), the rest from
    the decode worker; together they equal the offline engine's."""
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode("[logprobs] " + PROMPTS[1])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3)
    result = generate(decode.address, generate_request("lp", ids, params, prefill.address))
    reference = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    positions = [p for chunk in result.chunks for p in chunk.logprobs]
    assert result.token_ids == reference.token_ids and len(positions) == len(reference.logprobs) == 5
    for position, expected in zip(positions, reference.logprobs):
        assert [e.token_id for e in position.entries] == list(expected)
        for entry in position.entries:
            assert entry.logprob == pytest.approx(expected[entry.token_id].logprob, abs=1e-4)
            assert entry.rank == expected[entry.token_id].rank
            assert entry.decoded_token == expected[entry.token_id].decoded_token


def test_stalled_transfer_hits_the_deadline_and_frees_both_sides(smollm_pair, llm, ray_cluster, kv_pause):
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode("[stalled] " + PROMPTS[3])
    kv_pause.arm(3)
    request = generate_request("stalled", ids, SamplingParams(max_tokens=4), prefill.address)
    request.kv_deadline_ms = 3000  # the stalled sender never finishes: the decode worker gives up
    with pytest.raises(grpc.RpcError) as info:
        generate(decode.address, request)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: prefill.stats().num_held_transfers == 0, what="the stalled transfer released")
    wait_all_free(decode.stats)
    wait_all_free(prefill.stats)


def test_torch_transport_is_selected_per_request(smollm_pair, llm):
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode("[gloo] " + PROMPTS[2])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = decode.stats()
    result = generate(decode.address, generate_request("gloo-0", ids, params, prefill.address, pb.KV_TRANSPORT_TORCH))
    after = decode.stats()
    assert result.token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    assert after.kv_bytes_received - before.kv_bytes_received == len(ids) * kv_bytes_per_token(llm.config.model.arch)
    assert after.num_prompt_tokens_computed == before.num_prompt_tokens_computed


def test_decode_side_prefix_hit_sends_only_missing_blocks(smollm_pair, llm):
    prefill, decode = smollm_pair
    tokenizer = llm.get_tokenizer()
    shared = tokenizer.encode("[prefix] " + PROMPTS[3])  # computed on the decode worker first
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    generate(decode.address, generate_request("warm", shared, params))  # colocated: cached there
    follow_up = shared + tokenizer.encode(" In one sentence:")
    before = decode.stats()
    result = generate(decode.address, generate_request("hit", follow_up, params, prefill.address))
    after = decode.stats()
    cached = len(shared) // 16 * 16  # full blocks of the shared part
    per_token = kv_bytes_per_token(llm.config.model.arch)
    assert after.kv_bytes_received - before.kv_bytes_received == (len(follow_up) - cached) * per_token
    assert result.chunks[0].num_cached_tokens >= cached
    assert result.token_ids == llm.generate({"prompt_token_ids": follow_up}, params)[0].outputs[0].token_ids


def test_bad_request_is_refused_and_changes_nothing(smollm_pair):
    prefill, decode = smollm_pair
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for ids in ([], [10**9], list(range(600))):
        with pytest.raises(grpc.RpcError) as info:
            generate(decode.address, generate_request("bad", ids, params, prefill.address))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    bad_params = generate_request("bad", [1, 2, 3], params, prefill.address)
    bad_params.params.top_p = 5.0
    with pytest.raises(grpc.RpcError, match="top_p"):
        generate(decode.address, bad_params)
    with pytest.raises(grpc.RpcError) as info:  # without the cluster secret
        list(decode_stub(decode.address).Generate(generate_request("x", [1, 2], params), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    wait_all_free(decode.stats)
    wait_all_free(prefill.stats)


def test_worker_ports_answer_grpc_health_probes_without_the_secret(smollm_pair):
    """What a Kubernetes gRPC probe on the worker port sees; nothing else is open without the secret."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for worker in smollm_pair:
        with grpc.insecure_channel(worker.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as info:
                stub = pb_grpc.PrefillWorkerStub if worker.role == "prefill" else pb_grpc.DecodeWorkerStub
                stub(channel).Stats(pb.StatsRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_abort_during_prefill_and_during_decode_frees_both_sides(smollm_pair, llm, ray_cluster, kv_pause):
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode("[abort] " + PROMPTS[3])
    kv_pause.arm(3)
    stub = decode_stub(decode.address)
    call = stub.Generate(generate_request("ab-prefill", ids, SamplingParams(max_tokens=8), prefill.address),
                         metadata=METADATA, timeout=120)
    wait_until(kv_pause.holding, what="the held transfer")
    assert decode.stats().num_waiting_for_remote_kv == 1
    call.cancel()  # the client goes away while the prompt's KV is in flight
    wait_until(lambda: decode.stats().num_free_kv_blocks == decode.stats().num_kv_blocks, what="decode blocks")
    wait_until(lambda: prefill.stats().num_held_transfers == 0, what="prefill transfer released")
    wait_all_free(decode.stats)
    wait_all_free(prefill.stats)

    params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
    call = stub.Generate(generate_request("ab-decode", ids, params, prefill.address), metadata=METADATA, timeout=120)
    first = next(call)
    assert first.token_ids
    assert stub.Abort(pb.AbortRequest(request_id="ab-decode"), metadata=METADATA, timeout=30).found
    rest = collect(call)
    assert rest.last.finish_reason == "abort" and len(rest.token_ids) < 499
    wait_all_free(decode.stats)
    wait_all_free(prefill.stats)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_worker_killed_mid_transfer(policy, smollm_pair, llm, ray_cluster, kv_pause):
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode(f"[killed-{policy}] " + PROMPTS[3])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kv_pause.arm(4)
    before = decode.stats()
    grpc_policy = pb.KV_FAILURE_POLICY_RECOMPUTE if policy == "recompute" else pb.KV_FAILURE_POLICY_FAIL
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, decode.address,
                              generate_request(f"killed-{policy}", ids, params, prefill.address, policy=grpc_policy))
        wait_until(kv_pause.holding, what="the stall")
        wait_until(lambda: decode.stats().kv_bytes_received > before.kv_bytes_received, what="partial KV")
        ray_cluster.kill(prefill.actor, no_restart=False)  # Ray restarts it
        if policy == "recompute":
            result = pending.result(timeout=120)
            assert result.token_ids == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
            assert result.last.kv_recomputed
        else:
            with pytest.raises(grpc.RpcError) as info:
                pending.result(timeout=120)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "KV transfer failed" in info.value.details()
    after = decode.stats()
    assert (after.num_kv_recomputed - before.num_kv_recomputed, after.num_kv_failed - before.num_kv_failed) == (
        (1, 0) if policy == "recompute" else (0, 1))
    wait_all_free(decode.stats)
    prefill.refresh()  # the restarted actor serves again, on a new port, holding nothing
    wait_all_free(prefill.stats)


def test_worker_not_ready_in_time_is_a_clear_error(ray_cluster, smollm_dir):
    config = PrefillWorkerConfig(EngineArgs(model=str(smollm_dir)), ServerConfig("127.0.0.1", 0, SECRET))
    with pytest.raises(WorkerStartupError, match="not ready within"):
        launch_worker("prefill", config, Placement(num_cpus=64, ready_timeout_s=2))  # no node has 64 CPUs


def test_decode_worker_killed_leaves_nothing_held_on_the_prefill_worker(smollm_pair, llm, ray_cluster, kv_pause):
    prefill, decode = smollm_pair
    ids = llm.get_tokenizer().encode("[decode-killed] " + PROMPTS[3])
    kv_pause.arm(2)
    stub = decode_stub(decode.address)
    call = stub.Generate(generate_request("orphan", ids, SamplingParams(max_tokens=4), prefill.address, policy=0),
                         metadata=METADATA, timeout=120)
    wait_until(kv_pause.holding, what="the held transfer")
    assert prefill.stats().num_held_transfers == 1
    ray_cluster.kill(decode.actor, no_restart=False)  # nobody will collect this KV now
    with pytest.raises(grpc.RpcError):
        collect(call)
    wait_until(lambda: prefill.stats().num_held_transfers == 0, timeout_s=60, what="the orphaned transfer released")
    wait_all_free(prefill.stats)
    decode.refresh()
    wait_all_free(decode.stats)
