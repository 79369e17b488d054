"""A client that goes away at any moment of a request's admission on the decode worker (before
the engine thread has added it, while it does, right after) frees everything: no request is
left running for nobody, no block stays held. Real gRPC to an in-process decode worker."""

from __future__ import annotations

import asyncio
import random

import grpc

from engine import SamplingParams
from proto import worker_pb2_grpc as pb_grpc
from proto.rpc import CHANNEL_OPTIONS
from tests.workers import METADATA, generate_request, wait_all_free


def test_a_cancel_at_any_point_of_admission_frees_everything(smollm_decode_worker):
    decode_worker = smollm_decode_worker
    # long enough that a request left running would still be running when the check below runs
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    rng = random.Random(7)

    async def one(stub, index: int) -> None:
        call = stub.Generate(generate_request(f"cancel-{index}", [1 + index, 2, 3, 4, 5], params), metadata=METADATA,
                             timeout=60)
        await asyncio.sleep(rng.uniform(0, 0.03))  # from before the call reaches the worker to past its admission
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED

    async def run() -> None:
        async with grpc.aio.insecure_channel(decode_worker.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            for index in range(80):
                await one(stub, index)

    asyncio.run(run())
    wait_all_free(decode_worker.stats, timeout_s=5)
