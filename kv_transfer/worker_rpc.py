"""What both workers share on the wire: the grpc.aio server they serve their RPCs and the KV
stream on (one port per worker, the cluster secret checked on every call but the standard
health service's), and the conversions between the worker protos and the engine's types
(done here, at the edge)."""

from __future__ import annotations

import asyncio
import hmac
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.engine_core import EngineCore, EngineCoreOutput
from engine.outputs import PositionLogprobs
from engine.request import ErrorScope
from engine.sampling_params import InvalidParam, SamplingParams
from engine.step_budget import CHUNK_TOKEN_BUCKETS
from kv_transfer.grpc_transport import CHANNEL_OPTIONS, SECRET_METADATA_KEY
from proto import worker_pb2 as pb


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str  # the address other workers reach this one on ("" in a Ray actor: its node's)
    port: int  # 0: any free port
    cluster_secret: str  # every call must carry it (metadata x-tandem-cluster-secret)

    def __post_init__(self) -> None:
        if not self.cluster_secret:
            raise ValueError("a cluster secret is required: workers accept calls only from their cluster")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")


HEALTH_PREFIX = "/grpc.health.v1.Health/"


class _SecretCheck(grpc.aio.ServerInterceptor):
    """Rejects, with UNAUTHENTICATED, any call whose metadata lacks the cluster secret
    (compared in constant time). The handler keeps its method's shape so the caller sees
    the status, not a protocol error."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith(HEALTH_PREFIX):  # probes (kubelet) carry no secret; status only
            return handler
        sent = dict(details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if handler is None or hmac.compare_digest(str(sent).encode(), self._secret):
            return handler
        message = "missing or wrong cluster secret"

        async def deny(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover (abort raises)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
        }.get((handler.request_streaming, handler.response_streaming))
        if make is not None:
            return make(deny, request_deserializer=None, response_serializer=None)
        make = grpc.unary_stream_rpc_method_handler if not handler.request_streaming else grpc.stream_stream_rpc_method_handler
        return make(deny_stream, request_deserializer=None, response_serializer=None)


class WorkerServer:
    """A grpc.aio server on its own event-loop thread. ``register(server)`` adds the worker's
    services; it runs on that loop before the server starts."""

    def __init__(self, config: ServerConfig, register: Callable[[grpc.aio.Server], None]) -> None:
        self.config = config
        self._register = register
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio", daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port: int | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout_s)
        return self.address

    async def _start(self) -> int:
        self._server = grpc.aio.server(interceptors=[_SecretCheck(self.config.cluster_secret)],
                                       options=CHANNEL_OPTIONS)
        self._register(self._server)
        # the standard health service, for gRPC probes on the worker port (Kubernetes, grpc_health_probe)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        port = self._server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if port == 0:
            raise OSError(f"could not bind {self.config.host}:{self.config.port}")
        await self._server.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return port

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self.loop).result(5)
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result(grace_s + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


# -- errors on the worker RPCs ---------------------------------------------------------------
ERROR_SCOPE_KEY = "tandem-error-scope"  # trailing metadata of a failed Generate: an ErrorScope value
ERROR_PARAM_KEY = "tandem-error-param"  # trailing metadata of an INVALID_ARGUMENT: the field at fault
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


async def abort_invalid(context, exc: ValueError) -> None:
    """INVALID_ARGUMENT, naming the field when the engine did (InvalidParam)."""
    if isinstance(exc, InvalidParam):
        context.set_trailing_metadata(((ERROR_PARAM_KEY, exc.param),))
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise InvalidParam("request_id", f"request_id is {len(request_id)} characters; at most {MAX_REQUEST_ID_LEN}")


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    return ((SECRET_METADATA_KEY, secret),)


# -- proto <-> engine types ----------------------------------------------------------------
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "logprobs", "prompt_logprobs",
             "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens")


def params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep vLLM's defaults; raises ValueError on invalid values."""
    kwargs = {name: getattr(message, name) for name in _OPTIONAL if message.HasField(name)}
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = None  # unset: up to the context length
    return SamplingParams(
        stop=tuple(message.stop), stop_token_ids=tuple(message.stop_token_ids), ignore_eos=message.ignore_eos,
        min_tokens=message.min_tokens, include_stop_str_in_output=message.include_stop_str_in_output, **kwargs,
    )


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    message = pb.SamplingParams(
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output,
    )
    for name in _OPTIONAL:
        value = getattr(params, name)
        if value is not None:
            setattr(message, name, value)
    return message


def position_to_proto(position: PositionLogprobs | None) -> pb.PositionLogprobs:
    message = pb.PositionLogprobs()
    for token_id, entry in (position or {}).items():
        message.entries.add(token_id=token_id, logprob=entry.logprob, rank=entry.rank,
                            decoded_token=entry.decoded_token or "")
    return message


def output_to_chunk(output: EngineCoreOutput, num_prompt_tokens: int) -> pb.GenerateChunk:
    chunk = pb.GenerateChunk(
        token_ids=output.new_token_ids, text_delta=output.text_delta,
        logprobs=[position_to_proto(p) for p in output.new_logprobs],
        prompt_logprobs=[position_to_proto(p) for p in output.new_prompt_logprobs],
        finish_reason=output.finish_reason or "", num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens, kv_recomputed=output.kv_recomputed,
    )
    if isinstance(output.stop_reason, str):
        chunk.stop_string = output.stop_reason
    elif output.stop_reason is not None:
        chunk.stop_token_id = output.stop_reason
    return chunk


def worker_stats(core: EngineCore, role: str, address: str, kv_bytes_sent: int = 0,
                 num_held_transfers: int = 0, prefix_incarnation: str = "") -> pb.WorkerStats:
    scheduler, pool, counters = core.scheduler, core.block_pool, core.counters
    return pb.WorkerStats(
        role=role, address=address, num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free_blocks,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_waiting_for_remote_kv=len(scheduler.waiting_for_remote_kv),
        num_prompt_tokens_computed=counters.num_prompt_tokens_computed,
        num_generation_tokens=counters.num_generation_tokens,
        kv_bytes_received=core.kv_importer.num_bytes_received, kv_bytes_sent=kv_bytes_sent,
        num_kv_recomputed=counters.num_kv_recomputed, num_kv_failed=counters.num_kv_failed,
        num_held_transfers=num_held_transfers, max_num_running=counters.max_num_running,
        prefix_namespace=core.kv_manager.namespace, prefix_incarnation=prefix_incarnation,
        block_size=core.kv_manager.block_size, num_preemptions=scheduler.num_preemptions,
        prefix_cache_queried_tokens=core.kv_manager.stats.num_queried_tokens,
        prefix_cache_hit_tokens=core.kv_manager.stats.num_hit_tokens,
        prefill_chunk_bounds=CHUNK_TOKEN_BUCKETS, prefill_chunk_counts=list(scheduler.step_budget.chunk_counts),
        prefill_chunk_tokens_sum=scheduler.step_budget.chunk_sum,
    )
