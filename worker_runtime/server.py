"""The grpc.aio server every worker serves its RPCs and the KV stream on: one port per worker,
the cluster secret checked on every call but the standard health service's, on an event-loop
thread of its own."""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from engine.platform import name_native_thread
from proto.rpc import SECRET_METADATA_KEY, SERVER_OPTIONS


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
        self.last_call = time.monotonic()  # of the last authenticated call (a router polls Stats twice a second)

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if details.method.startswith(HEALTH_PREFIX):  # probes (kubelet) carry no secret; status only
            return handler
        sent = dict(details.invocation_metadata or ()).get(SECRET_METADATA_KEY, "")
        if handler is None:
            return handler
        if hmac.compare_digest(str(sent).encode(), self._secret):
            self.last_call = time.monotonic()
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
        self._thread = threading.Thread(target=self._serve_loop, name="grpc-aio", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._check = _SecretCheck(config.cluster_secret)
        self.port: int | None = None

    def _serve_loop(self) -> None:
        name_native_thread()
        self.loop.run_forever()

    def idle_s(self) -> float:
        """Seconds since the last call that carried the secret (or since this server was made)."""
        return time.monotonic() - self._check.last_call

    def touch(self) -> None:
        """Count now as a call: an owner that reached the worker another way (Ray)."""
        self._check.last_call = time.monotonic()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> str:
        self._thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout_s)
        return self.address

    async def _start(self) -> int:
        self._server = grpc.aio.server(interceptors=[self._check],
                                       options=SERVER_OPTIONS)
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

    def set_serving(self, serving: bool, timeout_s: float = 5.0) -> None:
        """The health service's status (any thread but the server's loop)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        if self._server is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.health.set("", status), self.loop).result(timeout_s)

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None and self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self.health.enter_graceful_shutdown(), self.loop).result(5)
            asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result(grace_s + 5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
