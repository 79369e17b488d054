"""The prefill worker: computes prompts (batched, chunked, with its own prefix cache), samples
each one's first token under the seed rule, and pushes the KV the decode worker lacks layer by
layer while later layers compute.

Threads: the engine loop owns the EngineCore; a grpc.aio loop serves Prefill / Abort / Stats.
Each request's KV leaves through a sink (prefill_worker/sinks.py) with its own sender thread.
A request's sink is dropped when its deadline passes, whoever was meant to collect it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from engine.engine_core import EngineCore, EngineCoreOutput
from engine.engine_loop import AddRequest, EngineLoopStopped
from engine.llm import EngineArgs
from engine.outputs import FinishReason
from engine.remote_kv import KVExport, prefill_side_params
from kv_transfer.torch_dist import TorchDistKVSink
from prefill_worker.sinks import GrpcRequestSink, GrpcSinkFactory, RequestSink, torch_request_sink
from prefix_index.publisher import PrefixIndexConfig
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import params_from_proto
from proto.rpc import CHANNEL_OPTIONS, Role
from telemetry.stages import prefill_spans
from telemetry.tracing import TracingConfig, extract
from worker_runtime.errors import abort_invalid, answer_stats, check_request_id
from worker_runtime.runtime import RuntimeConfig, WorkerRuntime
from worker_runtime.server import ServerConfig


@dataclass(frozen=True, slots=True)
class PrefillWorkerConfig:
    engine: EngineArgs
    server: ServerConfig
    prefix_index: PrefixIndexConfig | None = None  # publish cached blocks to Redis
    default_deadline_s: float = 30.0  # for requests that name none
    tracing: TracingConfig | None = None  # None: tracing off
    grpc_sink: GrpcSinkFactory = GrpcRequestSink  # makes each gRPC transfer's sink

    @property
    def runtime(self) -> RuntimeConfig:
        return RuntimeConfig(self.engine, self.server, self.prefix_index, self.tracing)


class PrefillWorker(pb_grpc.PrefillWorkerServicer):
    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        self.runtime = WorkerRuntime(Role.PREFILL, config.runtime,
                                     lambda server: pb_grpc.add_PrefillWorkerServicer_to_server(self, server))
        self.engine_loop = self.runtime.engine_loop
        self.core: EngineCore = self.runtime.core
        self._channels: dict[str, grpc.Channel] = {}  # decode worker address -> channel (aio loop only)
        self._torch_pairs: dict[str, TorchDistKVSink] = {}  # decode rendezvous -> pair (aio loop only)
        self._held: dict[str, RequestSink] = {}  # request id -> its transfer in flight (aio loop only)
        self.kv_bytes_sent = 0

    def start(self) -> str:
        """Serve, publish and step; returns host:port."""
        return self.runtime.start()

    def stop(self) -> None:
        for pair in self._torch_pairs.values():
            pair.finish(timeout_s=5)
        self.runtime.stop()

    @property
    def address(self) -> str:
        return self.runtime.address

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillReply:
        received = time.monotonic()
        if not request.params.HasField("seed"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Prefill needs the decode worker's seed")
        try:
            check_request_id(request.request_id)
        except ValueError as exc:
            await abort_invalid(context, exc)
        if request.request_id in self._held:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request '{request.request_id}' is already here")
        deadline = time.monotonic() + (request.deadline_ms / 1000 or self.config.default_deadline_s)
        try:
            params = prefill_side_params(params_from_proto(request.params), request.params.seed)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        sink = self._sink(request, deadline - time.monotonic())
        self._held[request.request_id] = sink
        finished: asyncio.Future = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wrap_future(self.engine_loop.add(AddRequest(
                request.request_id, list(request.prompt_token_ids), params, _Notify(finished),
                cache_salt=request.cache_salt or None, arrival_time=received,  # queue time starts at the call
                kv_export=KVExport(sink, request.kv_from_pos), priority=request.priority)))
            output = await asyncio.wait_for(finished, deadline - time.monotonic())
            if output.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                await context.abort(grpc.StatusCode.ABORTED, output.error or f"prefill ended: {output.finish_reason}")
            error = await asyncio.to_thread(sink.finish, max(0.0, deadline - time.monotonic()))
            if self.runtime.tracing is not None and output.times is not None:
                attributes = {"tandem.request_id": request.request_id, "tandem.worker": self.address,
                              "gen_ai.usage.input_tokens": len(request.prompt_token_ids),
                              "tandem.cached_tokens": output.num_cached_tokens, "tandem.kv_target": request.kv_target}
                prefill_spans(self.runtime.tracing, extract(context.invocation_metadata()), received, output.times,
                              sink.layer_sends, attributes, error)
            if error is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"pushing KV to {request.kv_target}: {error}")
            self.kv_bytes_sent += sink.bytes_sent
            return pb.PrefillReply(kv_bytes_sent=sink.bytes_sent, num_cached_tokens=output.num_cached_tokens,
                                   first_token_id=output.new_token_ids[0])
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except EngineLoopStopped as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "prefill and KV push did not finish in time")
        finally:  # cancelled, failed or done: nothing of this request stays here
            if not finished.done():
                self.engine_loop.abort(request.request_id)
            self._held.pop(request.request_id, None)
            sink.cancel()

    def _sink(self, request: pb.PrefillRequest, timeout_s: float) -> RequestSink:
        secret = self.config.server.cluster_secret
        if request.transport == pb.KV_TRANSPORT_TORCH:
            pair = self._torch_pairs.get(request.kv_target)
            if pair is None or not pair.is_alive:
                host, _, port = request.kv_target.rpartition(":")
                pair = TorchDistKVSink((host, int(port)), secret, timeout_s=self.config.default_deadline_s,
                                       device=self.core.kv_cache.storage.device)
                self._torch_pairs[request.kv_target] = pair
            return torch_request_sink(pair, request.request_id)
        channel = self._channels.get(request.kv_target)
        if channel is None:
            channel = self._channels[request.kv_target] = grpc.insecure_channel(request.kv_target, options=CHANNEL_OPTIONS)
        return self.config.grpc_sink(request.kv_target, secret, timeout_s, channel)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        found = await asyncio.wrap_future(self.engine_loop.abort(request.request_id))
        sink = self._held.get(request.request_id)
        if sink is not None:
            sink.cancel()
        return pb.AbortReply(found=found or sink is not None)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await answer_stats(context, self.stats)  # without waiting for the engine thread

    def stats(self) -> pb.WorkerStats:
        return self.runtime.stats(self.kv_bytes_sent, len(self._held))


class _Notify:
    """Engine-thread listener that resolves an asyncio future with the request's last output."""

    def __init__(self, future: asyncio.Future) -> None:
        self._future = future
        self._loop = future.get_loop()

    def __call__(self, output: EngineCoreOutput) -> None:
        if output.finish_reason is not None:
            self._loop.call_soon_threadsafe(self._set, output)

    def _set(self, output: EngineCoreOutput) -> None:
        if not self._future.done():
            self._future.set_result(output)
