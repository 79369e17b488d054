"""Talking to workers over real gRPC from tests (a plain sync client, as the router would)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc

from engine import SamplingParams
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from proto.rpc import CHANNEL_OPTIONS, secret_metadata

SECRET = "test-cluster-secret"
METADATA = secret_metadata(SECRET)


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: list[pb.GenerateChunk] = field(default_factory=list)

    @property
    def last(self) -> pb.GenerateChunk:
        return self.chunks[-1]


def decode_stub(address: str) -> pb_grpc.DecodeWorkerStub:
    return pb_grpc.DecodeWorkerStub(grpc.insecure_channel(address, options=CHANNEL_OPTIONS))


def generate_request(request_id: str, prompt_ids: list[int], params: SamplingParams, prefill: str | None = None,
                     transport=pb.KV_TRANSPORT_GRPC, policy=pb.KV_FAILURE_POLICY_FAIL) -> pb.GenerateRequest:
    request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params_to_proto(params),
                                 kv_failure_policy=policy)
    if prefill is not None:
        request.prefill.address = prefill
        request.prefill.transport = transport
    return request


def collect(call) -> Generated:
    result = Generated()
    for chunk in call:
        result.chunks.append(chunk)
        result.token_ids += chunk.token_ids
        result.text += chunk.text_delta
    return result


def generate(decode: str, request: pb.GenerateRequest, timeout_s: float = 120.0) -> Generated:
    return collect(decode_stub(decode).Generate(request, metadata=METADATA, timeout=timeout_s))


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def kv_bytes_per_token(arch, dtype_bytes: int = 4) -> int:
    """Bytes of one prompt position's KV over all layers."""
    return 2 * arch.num_key_value_heads * arch.head_dim * dtype_bytes * arch.num_hidden_layers


def wait_all_free(read_stats, timeout_s: float = 30.0) -> None:
    """Stats are read without waiting for the worker's engine thread, so a release that is one
    step away may not show yet: wait (with a deadline) until everything is free, then check."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = read_stats()
        if stats.num_free_kv_blocks == stats.num_kv_blocks and stats.num_running == stats.num_waiting == 0 \
                and stats.num_waiting_for_remote_kv == stats.num_held_transfers == 0:
            return
        time.sleep(0.05)
    assert_all_free(read_stats())


def assert_all_free(stats: pb.WorkerStats) -> None:
    assert stats.num_free_kv_blocks == stats.num_kv_blocks, (
        f"{stats.role}: {stats.num_kv_blocks - stats.num_free_kv_blocks} KV blocks still held")
    assert stats.num_running == stats.num_waiting == stats.num_waiting_for_remote_kv == 0, stats
    assert stats.num_held_transfers == 0, stats
