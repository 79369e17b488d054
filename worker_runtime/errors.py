"""How a worker ends a failed call: one table from the engine's error scope to the gRPC status,
the scope and the field at fault in the trailing metadata (proto/rpc.py names the keys), so
that the router can tell a request's own error (not retried) from a worker's fault."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from engine.engine_core import EngineCoreOutput
from engine.request import ErrorScope
from engine.sampling_params import InvalidParam
from proto import worker_pb2 as pb
from proto.rpc import ERROR_PARAM_KEY, ERROR_SCOPE_KEY


class EngineDead(RuntimeError):
    """The worker's engine loop died: it cannot step any request."""


MAX_REQUEST_ID_LEN = 256  # longer ids are refused (they travel in every KV frame's header)
_SCOPE_CODES = {
    ErrorScope.REQUEST: grpc.StatusCode.INTERNAL,  # not retried: another worker would fail it too
    ErrorScope.STEP: grpc.StatusCode.INTERNAL,
    ErrorScope.KV_TRANSFER: grpc.StatusCode.UNAVAILABLE,
    ErrorScope.ENGINE: grpc.StatusCode.UNAVAILABLE,
}


async def abort_failed(context, output: EngineCoreOutput) -> None:
    """End a call whose request failed in the engine: the status its scope calls for, the
    scope in the trailing metadata (the router retries only faults that are not the
    request's own)."""
    scope = output.error_scope or ErrorScope.STEP
    context.set_trailing_metadata(((ERROR_SCOPE_KEY, scope.value),))
    await context.abort(_SCOPE_CODES[scope], output.error or "the request failed")


async def answer_stats(context, read: Callable[[], pb.WorkerStats]) -> pb.WorkerStats:
    """A Stats call's answer; UNAVAILABLE once the engine loop died, so that the router takes
    the worker out of routing as it would an unreachable one."""
    try:
        return read()
    except EngineDead as exc:
        await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))


async def abort_invalid(context, exc: ValueError) -> None:
    """INVALID_ARGUMENT, naming the field when the engine did (InvalidParam)."""
    if isinstance(exc, InvalidParam):
        context.set_trailing_metadata(((ERROR_PARAM_KEY, exc.param),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidParam("request_id", f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_LEN}")
