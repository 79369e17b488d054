"""The SDK's retry rule against a scripted in-process gRPC server (real sockets): UNAVAILABLE
before anything arrived is retried with the same request id; after a token, never."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest

from client import AsyncTandemClient, SamplingParams, TandemClient, TandemError
from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc


class ScriptedGeneration(pb_grpc.GenerationServicer):
    """Fails the first ``failures`` calls with UNAVAILABLE, after ``tokens_before_failure``
    chunks; later calls answer one chunk and the final message."""

    def __init__(self, failures: int, tokens_before_failure: int = 0) -> None:
        self.failures = failures
        self.tokens_before_failure = tokens_before_failure
        self.request_ids: list[str] = []

    def Generate(self, request, context):
        self.request_ids.append(request.request_id)
        if len(self.request_ids) <= self.failures:
            for index in range(self.tokens_before_failure):
                yield pb.GenerationResponse(request_id=request.request_id,
                                            chunk=pb.GenerationChunk(token_ids=[index], text="x"))
            context.abort(grpc.StatusCode.UNAVAILABLE, "scripted failure")
        yield pb.GenerationResponse(request_id=request.request_id,
                                    chunk=pb.GenerationChunk(token_ids=[7], text="ok", finish_reason="length"))
        yield pb.GenerationResponse(request_id=request.request_id, final=pb.GenerationFinal(
            usage=pb.Usage(prompt_tokens=2, completion_tokens=1), choices=[pb.ChoiceEnd(finish_reason="length")]))


@pytest.fixture
def scripted():
    def start(servicer):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    servers: list[grpc.Server] = []
    yield start
    for server in servers:
        server.stop(None)


def test_unavailable_before_the_first_token_is_retried_with_the_same_id(scripted):
    servicer = ScriptedGeneration(failures=2)
    with TandemClient(scripted(servicer), max_retries=2) as tandem:
        done = tandem.complete("hi", SamplingParams(max_tokens=1), request_id="fixed-id")
    assert done.choices[0].text == "ok" and done.usage.completion_tokens == 1
    assert servicer.request_ids == ["fixed-id"] * 3


def test_retries_run_out(scripted):
    servicer = ScriptedGeneration(failures=5)
    with TandemClient(scripted(servicer), max_retries=1) as tandem, pytest.raises(TandemError) as info:
        tandem.complete("hi")
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and len(servicer.request_ids) == 2


def test_no_retry_once_a_token_has_arrived(scripted):
    servicer = ScriptedGeneration(failures=1, tokens_before_failure=1)
    target = scripted(servicer)
    with TandemClient(target, max_retries=3) as tandem:
        stream = tandem.generate("hi")
        assert next(stream).token_ids == [0]
        with pytest.raises(TandemError) as info:
            next(stream)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE and len(servicer.request_ids) == 1

    async def run_async():
        async with AsyncTandemClient(target, max_retries=3) as tandem:
            return await tandem.complete("hi", request_id="async-id")

    done = asyncio.run(run_async())  # the script's failures are used up: answered first time
    assert done.choices[0].text == "ok" and servicer.request_ids[-1] == "async-id"
