"""Time to first token of a disaggregated request against a colocated prefill of the same
prompt, measured in the same run: a prefill worker and a decode worker (real gRPC, KV pushed
layer by layer) in this process, with the same torch thread count for both paths."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import grpc
import torch

from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from proto.rpc import CHANNEL_OPTIONS, secret_metadata
from worker_runtime.server import ServerConfig

SECRET = "bench-secret"


@dataclass(frozen=True, slots=True)
class TTFTResult:
    prompt_tokens: int
    threads: int  # torch threads of the computing side, both paths
    colocated_ms: float  # median over rounds
    disaggregated_ms: float
    rounds: int

    @property
    def ratio(self) -> float:
        return self.disaggregated_ms / self.colocated_ms


def ttft(model: str, prompt_tokens: int, threads: int, rounds: int = 3) -> TTFTResult:
    from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from engine import SamplingParams
    from engine.llm import EngineArgs
    from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig

    engine = EngineArgs(model=model, dtype="float32", max_model_len=prompt_tokens + 64, num_threads=threads,
                        enable_prefix_caching=False)
    server = ServerConfig("127.0.0.1", 0, SECRET)
    prefill = PrefillWorker(PrefillWorkerConfig(engine, server))
    decode = DecodeWorker(DecodeWorkerConfig(engine, server, kv_deadline_s=600))
    prefill_address, decode_address = prefill.start(), decode.start()
    stub = pb_grpc.DecodeWorkerStub(grpc.insecure_channel(decode_address, options=CHANNEL_OPTIONS))
    params = params_to_proto(SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    timings: dict[str, list[float]] = {"colocated": [], "disaggregated": []}
    try:
        for index in range(rounds + 1):  # round 0 warms both paths up and is not counted
            generator = torch.Generator().manual_seed(index)
            for label in timings:
                ids = torch.randint(100, 40000, (prompt_tokens,), generator=generator).tolist()
                request = pb.GenerateRequest(request_id=f"{label}-{index}", prompt_token_ids=ids, params=params,
                                             kv_failure_policy=pb.KV_FAILURE_POLICY_FAIL)
                if label == "disaggregated":
                    request.prefill.address = prefill_address
                start = time.perf_counter()
                call = stub.Generate(request, metadata=secret_metadata(SECRET), timeout=600)
                next(call)
                elapsed = time.perf_counter() - start
                for _ in call:
                    pass
                if index:
                    timings[label].append(elapsed * 1000)
    finally:
        prefill.stop()
        decode.stop()
    return TTFTResult(prompt_tokens, threads, statistics.median(timings["colocated"]),
                      statistics.median(timings["disaggregated"]), rounds)


def render_ttft(result: TTFTResult) -> str:
    return (f"time to first token, {result.prompt_tokens}-token prompt, {result.threads} threads, median of "
            f"{result.rounds}: colocated {result.colocated_ms:.0f} ms, disaggregated {result.disaggregated_ms:.0f} ms "
            f"({result.ratio:.2f}x colocated; target <= 1.10x)")
