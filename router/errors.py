"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, with the
status codes OpenAI clients expect (400 for validation, never FastAPI's 422)."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str) -> str:
    """The event that ends a stream that failed after it began (then ``data: [DONE]``)."""
    return f"data: {json.dumps(error_body(status, message))}\n\n"


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's first error as an OpenAI message and ``param`` (HTTP and gRPC alike)."""
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":  # the body is not JSON: no field is at fault
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', message)}", None
    if first.get("type") == "extra_forbidden":
        message = f"unknown field '{location[-1]}'" if location else "unknown field"
    elif location:
        message = f"{'.'.join(location)}: {message}"
    return message, ".".join(location) if location else None  # an unknown field named "" is param ""


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = validation_message(exc.errors())
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}")
