"""AsyncTandemClient: the asyncio client (grpc.aio), with the same methods as TandemClient."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from client._requests import (
    KEEPALIVE_OPTIONS, Messages, Prompt, RequestOptions, backoff_s, credentials, generation_request, metadata,
    should_retry, tokenize_request,
)
from client.params import SamplingParams
from client.types import Chunk, Completion, CompletionBuilder, ModelCard, TandemError, chunk_from_proto
from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc


class AsyncTandemClient:
    """``async with AsyncTandemClient("host:50051") as client: ...`` (see TandemClient)."""

    def __init__(self, target: str, api_key: str | None = None, model: str = "smollm2-135m-instruct",
                 timeout_s: float | None = 300.0, root_certificates: bytes | None = None, tls: bool = False,
                 max_retries: int = 2) -> None:
        creds = credentials(root_certificates, tls)
        self._channel = (grpc.aio.secure_channel(target, creds, options=KEEPALIVE_OPTIONS) if creds
                         else grpc.aio.insecure_channel(target, options=KEEPALIVE_OPTIONS))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._metadata = metadata(api_key)
        self.model = model
        self.timeout_s = timeout_s
        self.max_retries = max_retries

    async def __aenter__(self) -> "AsyncTandemClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def _responses(self, request: pb.GenerationRequest,
                         timeout_s: float | None) -> AsyncIterator[pb.GenerationResponse]:
        attempt = 0
        while True:
            call = self._stub.Generate(request, metadata=self._metadata, timeout=timeout_s or self.timeout_s)
            received_any = False
            try:
                async for response in call:
                    received_any = True
                    yield response
                return
            except grpc.aio.AioRpcError as error:
                if not should_retry(error, received_any, attempt, self.max_retries):
                    raise TandemError.from_rpc(error) from None
            finally:
                call.cancel()
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1

    async def generate(self, prompt: Prompt | None = None, params: SamplingParams | None = None, *,
                       messages: Messages | None = None, n: int = 1, request_id: str | None = None,
                       timeout_s: float | None = None, priority: int | None = None, traffic_class: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[Chunk]:
        request = generation_request(self.model, prompt, messages, params,
                                     RequestOptions(n, request_id, priority, traffic_class, cache_salt))
        async for response in self._responses(request, timeout_s):
            if response.WhichOneof("kind") == "chunk":
                yield chunk_from_proto(response.chunk)

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, n: int = 1,
                       request_id: str | None = None, timeout_s: float | None = None,
                       priority: int | None = None, traffic_class: str | None = None,
                       cache_salt: str | None = None) -> Completion:
        return await self._collect(generation_request(self.model, prompt, None, params, RequestOptions(
            n, request_id, priority, traffic_class, cache_salt)), timeout_s)

    async def chat(self, messages: Messages, params: SamplingParams | None = None, *, n: int = 1,
                   request_id: str | None = None, timeout_s: float | None = None,
                   priority: int | None = None, traffic_class: str | None = None,
                   cache_salt: str | None = None) -> Completion:
        return await self._collect(generation_request(self.model, None, messages, params, RequestOptions(
            n, request_id, priority, traffic_class, cache_salt)), timeout_s)

    async def _collect(self, request: pb.GenerationRequest, timeout_s: float | None) -> Completion:
        builder = CompletionBuilder()
        async for response in self._responses(request, timeout_s):
            builder.add(response)
        return builder.build()

    async def tokenize(self, text: str | None = None, *, messages: Messages | None = None) -> list[int]:
        try:
            reply = await self._stub.Tokenize(tokenize_request(self.model, text, messages), metadata=self._metadata,
                                              timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            raise TandemError.from_rpc(error) from None
        return list(reply.token_ids)

    async def models(self) -> list[ModelCard]:
        try:
            reply = await self._stub.ListModels(pb.ListModelsRequest(), metadata=self._metadata, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as error:
            raise TandemError.from_rpc(error) from None
        return [ModelCard(m.id, m.max_model_len, m.owned_by, m.created) for m in reply.models]
