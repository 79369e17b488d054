"""The OpenAI-compatible HTTP gateway (FastAPI). Routes: /v1/completions,
/v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /health, /ready, /metrics
(and FastAPI's /openapi.json)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router import errors, openapi
from router.errors import APIError, error_response
from router.limits import check_input_chars, check_request_id, check_token_ids
from router.openai_api import admit, chat_token_ids, respond
from router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from router.state import RouterState

logger = logging.getLogger("tandem.router")

VERSION = "0.1.0"
_OPEN_PATHS = {"/health", "/ready", "/metrics"}


def build_app(state: RouterState) -> FastAPI:
    app = FastAPI(title="tandem", version=VERSION)
    app.state.router = state
    errors.install(app)
    openapi.install(app, state)
    app.add_middleware(_BodyLimit, max_bytes=state.config.max_body_bytes)
    app.add_middleware(_RequestContext, state=state)  # outermost: every response carries the id
    _generation_routes(app, state)
    _token_routes(app, state)
    _service_routes(app, state)
    return app


def _generation_routes(app: FastAPI, state: RouterState) -> None:
    async def generate(body: CompletionRequest | ChatCompletionRequest, request: Request):
        prepared = await admit(state, body, request.state.request_id)
        if body.stream:  # StreamingResponse itself stops when the client goes away
            return await respond(state, prepared, body.stream)
        return await _unless_disconnected(request, respond(state, prepared, body.stream))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await generate(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await generate(body, request)

    @app.get("/v1/models")
    async def models():
        card = {"id": state.config.served_model_name, "object": "model", "created": int(state.started),
                "owned_by": "tandem", "root": state.config.served_model_name,
                "max_model_len": state.config.max_model_len}
        return {"object": "list", "data": [card]}


def _token_routes(app: FastAPI, state: RouterState) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        state.check_model(body.model)
        limits = state.config.limits
        if body.messages is not None:
            check_input_chars(limits, [m.text() for m in body.messages], "messages")
        else:
            check_input_chars(limits, [body.prompt], "prompt")
        async with state.admitted():
            tokens = await state.run_frontend(lambda: _tokenize(state, body))
        return {"count": len(tokens), "max_model_len": state.config.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        state.check_model(body.model)
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        async with state.admitted():
            text = await state.run_frontend(lambda: state.tokenizer.decode(body.tokens))
        return {"prompt": text}


def _service_routes(app: FastAPI, state: RouterState) -> None:
    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        if state.draining or not state.pool.is_ready:
            return JSONResponse({"ready": False}, status_code=503)
        return {"ready": True}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)


async def _unless_disconnected(request: Request, answer: Awaitable[Response]) -> Response:
    """A whole (not streamed) answer, cancelled, and with it the request on every worker, if
    the client goes away first: nothing else notices before the answer is written."""
    work = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    if work.cancelled() or not work.done():
        with contextlib.suppress(asyncio.CancelledError):
            await work
        logger.info("request %s: the client went away; cancelled", request.state.request_id)
        return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
    return work.result()


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed its connection (the body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tokenize(state: RouterState, body: TokenizeRequest) -> list[int]:
    if body.messages is None:
        return state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    conversation = [{"role": m.role, "content": m.text()} for m in body.messages]
    return chat_token_ids(state, conversation, body.add_generation_prompt)[1]


class _HTTPMiddleware:
    """Plain ASGI middleware (not BaseHTTPMiddleware, so that streamed chunks pass straight
    through) that sees HTTP requests only; the rest (lifespan) goes by untouched."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        return await self.http(scope, receive, send)

    async def http(self, scope, receive, send) -> None:
        raise NotImplementedError


class _RequestContext(_HTTPMiddleware):
    """X-Request-Id in and out, the API key, and one structured log line per request."""

    def __init__(self, app, state: RouterState) -> None:
        super().__init__(app)
        self.state = state

    async def http(self, scope, receive, send) -> None:
        headers = dict(scope.get("headers", ()))
        given, request_id, refused = headers.get(b"x-request-id"), uuid.uuid4().hex, None
        if given is not None:
            try:
                request_id = check_request_id(given.decode("latin-1"), "X-Request-Id")
            except APIError as exc:  # answered with a 400 that carries one of our ids
                refused = exc
        scope.setdefault("state", {})["request_id"] = request_id
        path, start, status = scope["path"], time.perf_counter(), [500]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode())]
            await send(message)

        authorization = headers.get(b"authorization", b"").decode("latin-1")
        if refused is not None:
            await error_response(400, refused.message, refused.param)(scope, receive, send_with_id)
        elif path not in _OPEN_PATHS and not self.state.check_key(authorization):
            response = error_response(401, "invalid or missing API key (send Authorization: Bearer <key>)")
            await response(scope, receive, send_with_id)
        else:
            await self.app(scope, receive, send_with_id)
        if path.startswith("/v1/"):
            elapsed = time.perf_counter() - start
            logger.info(json.dumps({"request_id": request_id, "method": scope["method"], "path": path,
                                    "status": status[0], "seconds": round(elapsed, 4)}))


class _BodyLimit(_HTTPMiddleware):
    """413 for bodies over the limit, whether or not they declare a Content-Length."""

    def __init__(self, app, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def http(self, scope, receive, send) -> None:
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send) -> None:
        response = error_response(413, f"request body larger than {self.max_bytes} bytes")
        await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body})


class _TooLarge(Exception):
    pass
