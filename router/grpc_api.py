"""The public gRPC API (`tandem.v1.Generation`, proto/generation.proto): the same validation,
dispatch and accounting as the HTTP API, answered as protobuf. Also the standard
grpc.health.v1 health service and server reflection."""

from __future__ import annotations

import uuid

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from pydantic import ValidationError

from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc
from proto.rpc import ERROR_PARAM_KEY
from router.dispatch import SequenceChunk
from router.errors import APIError, validation_message
from router.limits import check_input_chars, check_request_id
from router.openai_api import Choice, admit, chat_token_ids, usage_of
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.state import RouterState

SERVICE = "tandem.v1.Generation"
_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED,
          404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.INVALID_ARGUMENT,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE,
          504: grpc.StatusCode.DEADLINE_EXCEEDED}
_SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),  # ping idle clients so dead connections are noticed
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # accept client keepalives this often
    ("grpc.keepalive_permit_without_calls", 1),
]
_PARAM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty", "skip_special_tokens")


def _request_body(request: pb.GenerationRequest) -> dict:
    """The HTTP API's body for the same request (validated by the same models)."""
    params = request.params
    body = {name: getattr(params, name) for name in _PARAM_FIELDS if params.HasField(name)}
    body.update(model=request.model, n=request.n or 1, stop=list(params.stop) or None,
                stop_token_ids=list(params.stop_token_ids) or None, ignore_eos=params.ignore_eos,
                min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output)
    if request.HasField("priority"):
        body["priority"] = request.priority
    for name in ("traffic_class", "cache_salt"):  # "" is unset, as the HTTP API's absent field
        if getattr(request, name):
            body[name] = getattr(request, name)
    if params.HasField("prompt_logprobs"):
        raise APIError(400, "prompt_logprobs is not supported over gRPC yet; use the HTTP API's echo",
                       "params.prompt_logprobs")
    kind = request.WhichOneof("input")
    if kind == "chat":
        body["messages"] = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        if params.HasField("logprobs"):
            body.update(logprobs=True, top_logprobs=params.logprobs)
    else:
        if kind is None:
            raise APIError(400, "give the input: text, chat or token_ids", "input")
        body["prompt"] = request.text if kind == "text" else list(request.token_ids.ids)
        if params.HasField("logprobs"):
            body["logprobs"] = params.logprobs
    return body


def request_model(request: pb.GenerationRequest) -> CompletionRequest | ChatCompletionRequest:
    """The HTTP API's request model for a gRPC request: the same validation and the same
    translation into engine parameters (pydantic's ValidationError where a field is bad)."""
    body = _request_body(request)
    model = ChatCompletionRequest if "messages" in body else CompletionRequest
    return model.model_validate(body)


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, state: RouterState) -> None:
        self.state = state

    async def _check_key(self, context) -> None:
        sent = dict(context.invocation_metadata() or ()).get("authorization")
        if not self.state.check_key(sent):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key "
                                "(send metadata authorization: Bearer <key>)")

    async def _abort(self, context, exc: APIError | ValidationError) -> None:
        """The HTTP API's error as a gRPC status; the field at fault, if any, in the trailing
        metadata ``tandem-error-param``."""
        if isinstance(exc, ValidationError):
            message, param = validation_message(exc.errors())
            exc = APIError(400, message, param)
        if exc.param:
            context.set_trailing_metadata(((ERROR_PARAM_KEY, exc.param),))
        await context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

    async def Generate(self, request: pb.GenerationRequest, context):
        await self._check_key(context)
        state = self.state
        try:
            request_id = check_request_id(request.request_id, "request_id") if request.request_id else uuid.uuid4().hex
            prepared = await admit(state, request_model(request), request_id)
        except (APIError, ValidationError) as exc:
            await self._abort(context, exc)
        choices = {s.index: Choice(s.index, s.prompt_index) for s in prepared.sequences}
        try:
            async for item in state.dispatcher.merged(prepared.sequences):
                if not isinstance(item, SequenceChunk):
                    await context.abort(_CODES.get(item.error.status, grpc.StatusCode.INTERNAL), item.error.message)
                choice = choices[item.sequence.index]
                choice.add(item.chunk)
                state.record_chunk(prepared, choice, item.chunk)
                yield pb.GenerationResponse(request_id=request_id, chunk=_chunk(choice.index, item.chunk))
            usage = usage_of(prepared, choices.values())
            final = pb.GenerationFinal(
                usage=pb.Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
                               cached_tokens=usage["prompt_tokens_details"]["cached_tokens"]),
                choices=[pb.ChoiceEnd(index=c.index, finish_reason=c.finish_reason or "")
                         for c in sorted(choices.values(), key=lambda c: c.index)])
            yield pb.GenerationResponse(request_id=request_id, final=final)
        finally:
            state.finish_request(prepared, choices.values())

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        await self._check_key(context)
        state = self.state
        chat = request.WhichOneof("input") == "chat"
        try:
            state.check_model(request.model or None)
            texts = [m.content for m in request.chat.messages] if chat else [request.text]
            check_input_chars(state.config.limits, texts, "chat" if chat else "text")
            async with state.admitted():
                ids = await state.run_frontend(lambda: _tokenize(state, request, chat))
        except APIError as exc:
            await self._abort(context, exc)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=state.config.max_model_len)

    async def ListModels(self, request: pb.ListModelsRequest, context) -> pb.ListModelsResponse:
        await self._check_key(context)
        card = pb.ModelCard(id=self.state.config.served_model_name, max_model_len=self.state.config.max_model_len,
                            owned_by="tandem", created=int(self.state.started))
        return pb.ListModelsResponse(models=[card])


def _tokenize(state: RouterState, request: pb.TokenizeRequest, chat: bool) -> list[int]:
    if not chat:
        return state.tokenizer.encode(request.text)
    conversation = [{"role": m.role, "content": m.content} for m in request.chat.messages]
    return chat_token_ids(state, conversation, True, "chat")[1]


def _chunk(index: int, chunk) -> pb.GenerationChunk:
    message = pb.GenerationChunk(index=index, token_ids=chunk.token_ids, text=chunk.text_delta,
                                 logprobs=chunk.logprobs, finish_reason=chunk.finish_reason)
    kind = chunk.WhichOneof("stop_reason")
    if kind is not None:
        setattr(message, kind, getattr(chunk, kind))
    return message


class PublicGrpcServer:
    """The router's gRPC front: Generation, health (per service) and reflection, on the
    router's event loop."""

    def __init__(self, state: RouterState, host: str, port: int, tls: tuple[bytes, bytes] | None = None) -> None:
        self.state = state
        # a request message may be as large as an HTTP body (16 MiB), no larger
        limit = [("grpc.max_receive_message_length", state.config.max_body_bytes)]
        self.server = grpc.aio.server(options=_SERVER_OPTIONS + limit)
        pb_grpc.add_GenerationServicer_to_server(GenerationServicer(state), self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        address = f"{host}:{port}"
        if tls is not None:
            self.port = self.server.add_secure_port(address, grpc.ssl_server_credentials([(tls[1], tls[0])]))
        else:
            self.port = self.server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"could not bind the gRPC API to {address}")

    async def start(self, serving: bool = True) -> None:
        await self.server.start()
        await self.set_serving(serving)

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in ("", SERVICE):
            await self.health.set(service, status)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        await self.server.stop(grace_s)
