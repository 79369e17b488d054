"""A worker whose engine loop died says so and stops serving (DESIGN.md's failure rules): its
gRPC health turns NOT_SERVING, Stats fails as an unreachable worker's would (the router then
takes it out of routing), new requests get UNAVAILABLE (another worker may serve them), and
the request that was running gets an error instead of hanging. Under Ray the process then
ends so that Ray restarts it (tests/chaos/test_lost_workers.py). Real gRPC to an in-process
decode worker; the loop is killed by making the core fail outside a step, which no request can
cause and nothing catches."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from engine.llm import EngineArgs
from proto import worker_pb2 as pb
from tests.workers import METADATA, SECRET, collect, decode_stub, generate_request, wait_until
from worker_runtime.server import ServerConfig


def test_a_dead_engine_loop_stops_serving_and_fails_its_requests(tiny_llama_dir, monkeypatch):
    engine = EngineArgs(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    worker = DecodeWorker(DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET)))
    exits = []
    worker.runtime.exit_on_engine_death = lambda: exits.append(True)  # what the Ray actor sets: exit the process
    worker.start()
    try:
        stub = decode_stub(worker.address)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        running = stub.Generate(generate_request("running", [1, 2, 3], params), metadata=METADATA, timeout=60)
        first = next(running)
        assert first.token_ids
        dying = threading.Event()
        real = worker.core.has_unfinished_requests

        def fails_once_armed():
            if dying.is_set():
                raise RuntimeError("the core broke outside a step")
            return real()

        monkeypatch.setattr(worker.core, "has_unfinished_requests", fails_once_armed)
        dying.set()
        with pytest.raises(grpc.RpcError) as info:
            collect(running)  # the running stream ends with an error, not a hang
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: exits, what="the engine-death hook")
        with grpc.insecure_channel(worker.address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as info:
            stub.Stats(pb.StatsRequest(), metadata=METADATA, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "engine loop died" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            collect(stub.Generate(generate_request("late", [1, 2, 3], params), metadata=METADATA, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        worker.stop()
