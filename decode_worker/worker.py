"""The decode worker: admits requests, reserves their KV blocks, gets their prompt's KV from a
prefill worker (or prefills locally), runs continuous-batching decode and streams tokens.

Threads: the engine loop owns the EngineCore; a grpc.aio loop serves Generate / Abort / Stats
and the KV Push stream on one port, and calls prefill workers. KV arriving on the stream (or
over torch.distributed) goes through the EngineInbox, applied by the engine loop between
steps. Ray only starts this object (cluster/actors.py); nothing here knows about Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import grpc

from engine.engine_core import EngineCore, EngineCoreOutput
from engine.engine_loop import AddRequest, EngineLoopStopped, NoFreeBlocks, RemoteKV
from engine.llm import EngineArgs
from engine.remote_kv import KVFailurePolicy
from kv_transfer.grpc_transport import GrpcKVReceiver
from kv_transfer.inbox import EngineInbox, TransferFailed
from kv_transfer.session import KVReceiver
from kv_transfer.torch_dist import TorchDistKVReceiver
from prefix_index.publisher import PrefixIndexConfig
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import output_to_chunk, params_from_proto, params_to_proto
from proto.rpc import CHANNEL_OPTIONS, Role, secret_metadata
from telemetry.stages import decode_spans, decode_stage_times
from telemetry.tracing import TracingConfig, extract, inject
from worker_runtime.errors import abort_failed, abort_invalid, answer_stats, check_request_id
from worker_runtime.runtime import RuntimeConfig, WorkerRuntime
from worker_runtime.server import ServerConfig

logger = logging.getLogger(__name__)

_POLICIES = {
    pb.KV_FAILURE_POLICY_RECOMPUTE: KVFailurePolicy.RECOMPUTE,
    pb.KV_FAILURE_POLICY_FAIL: KVFailurePolicy.FAIL,
}


@dataclass(frozen=True, slots=True)
class DecodeWorkerConfig:
    engine: EngineArgs
    server: ServerConfig
    kv_failure_policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE  # --kv-failure-policy
    prefix_index: PrefixIndexConfig | None = None  # publish cached blocks to Redis
    kv_deadline_s: float = 30.0  # how long a prompt's KV may take to land
    stall_timeout_s: float = 300.0  # a stream with no output for this long is failed
    tracing: TracingConfig | None = None  # None: tracing off

    @property
    def runtime(self) -> RuntimeConfig:
        return RuntimeConfig(self.engine, self.server, self.prefix_index, self.tracing)


@dataclass(slots=True)
class _Admission:
    """What admission decided for one request, and when its stages happened."""

    seed: int  # the sampling seed both workers use
    num_prompt_tokens: int
    kv_from_pos: int | None  # remote prefill: the sender starts here; None: prefilled locally
    received: float = 0.0  # time.monotonic() when the Generate call arrived
    prefill_sent: float | None = None  # ... when the Prefill call left for the prefill worker
    trace_parent: object | None = None  # the router's request span (tracing on)


class _Mailbox:
    """Outputs from the engine thread to the aio loop with one wake-up per step, not one per
    stream: ``post`` queues, ``flush`` (the engine loop's ``after_outputs``) hands the step's
    whole batch over. Each wake-up is a GIL hand-off that the engine thread waits out before
    its next step. Engine thread only, both."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: list[tuple[_Stream, EngineCoreOutput]] = []

    def post(self, stream: _Stream, output: EngineCoreOutput) -> None:
        self._pending.append((stream, output))

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        if pending:
            self._loop.call_soon_threadsafe(_deliver, pending)


def _deliver(pending: list[tuple[_Stream, EngineCoreOutput]]) -> None:  # aio loop
    """A step's outputs: chunks of requests bound to an Outputs stream go there, one message
    per stream; the rest (and every last output) to their Generate call."""
    steps: dict[_OutputsStream, pb.StepOutputs] = {}
    for stream, output in pending:
        shared = stream.shared
        if shared is None or output.finish_reason is not None or output.error is not None:
            stream.outputs.put_nowait(output)
        elif not shared.is_closed:  # closed: the Generate call has ended with UNAVAILABLE
            step = steps.get(shared)
            if step is None:
                step = steps[shared] = pb.StepOutputs()
            step.outputs.add(request_id=stream.request_id,
                             chunk=output_to_chunk(output, stream.num_prompt_tokens))
            stream.num_streamed += 1
            stream.progressed = time.monotonic()
    for shared, step in steps.items():
        shared.steps.put_nowait(step)


@dataclass(eq=False, slots=True)
class _OutputsStream:
    """One Outputs call: the step messages it has still to send, and the Generate streams
    bound to it (they end when it does). Aio loop only."""

    stream_id: str
    steps: asyncio.Queue = field(default_factory=asyncio.Queue)  # pb.StepOutputs, in step order
    bound: set[_Stream] = field(default_factory=set)
    is_closed: bool = False


class _StreamClosed:
    """Put in a bound Generate call's queue when its Outputs stream ends: chunks it sent may
    not have arrived, so the call ends with UNAVAILABLE and the router resumes elsewhere from
    the tokens it has."""


@dataclass(eq=False, slots=True)
class _Stream:
    """One Generate call's mailbox: the engine thread puts outputs, the handler awaits them
    (with an Outputs stream, only the last; the rest go there)."""

    mailbox: _Mailbox
    request_id: str
    num_prompt_tokens: int
    shared: _OutputsStream | None = None  # the Outputs stream its chunks but the last go to
    num_streamed: int = 0  # chunks sent there so far
    progressed: float = 0.0  # time.monotonic() of the latest of them (the stall timeout counts from it)
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)  # EngineCoreOutput | _StreamClosed

    def put(self, output: EngineCoreOutput) -> None:  # engine thread
        self.mailbox.post(self, output)


class DecodeWorker(pb_grpc.DecodeWorkerServicer):
    def __init__(self, config: DecodeWorkerConfig) -> None:
        self.config = config
        self.inbox = EngineInbox()
        self.runtime = WorkerRuntime(Role.DECODE, config.runtime, self._register,
                                     before_step=lambda core: self.inbox.drain_into(core).outputs,
                                     after_outputs=self._flush_outputs)
        self._mailbox = _Mailbox(self.runtime.server.loop)
        self.engine_loop = self.runtime.engine_loop
        self.core: EngineCore = self.runtime.core
        self.inbox.on_put = self.engine_loop.wake
        cache = self.core.kv_cache.layers[0]
        self._token_shape = tuple(cache.shape[2:])
        self._grpc_receiver = GrpcKVReceiver(self.inbox, cache.dtype, self._token_shape, lambda: self.address)
        self._metadata = secret_metadata(config.server.cluster_secret)
        self._prefill_stubs: dict[str, pb_grpc.PrefillWorkerStub] = {}  # address -> stub (aio loop only)
        self._torch_receivers: dict[str, TorchDistKVReceiver] = {}  # prefill address -> live pair
        self._outputs: dict[str, _OutputsStream] = {}  # stream id -> open Outputs call (aio loop only)

    def _register(self, server: grpc.aio.Server) -> None:
        pb_grpc.add_DecodeWorkerServicer_to_server(self, server)
        server.add_generic_rpc_handlers((self._grpc_receiver.handler(),))

    def start(self) -> str:
        """Serve, publish and step; returns host:port."""
        return self.runtime.start()

    def stop(self) -> None:
        self.runtime.stop()

    def _flush_outputs(self) -> None:  # engine thread, after each batch of outputs
        self._mailbox.flush()

    @property
    def address(self) -> str:
        return self.runtime.address

    # -- Generate -----------------------------------------------------------------------------
    async def Generate(self, request: pb.GenerateRequest, context):
        received = time.monotonic()
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        stream = _Stream(self._mailbox, request_id, len(request.prompt_token_ids),
                         shared=self._outputs.get(request.outputs_stream) if request.outputs_stream else None)
        try:
            check_request_id(request_id)
            params = params_from_proto(request.params)
            added = await asyncio.wrap_future(self.engine_loop.add(self._add_request(request_id, request, params,
                                                                                     stream)))
            admission = _Admission(added.seed, added.num_prompt_tokens, added.kv_from_pos, received)
            if self.runtime.tracing is not None:
                admission.trace_parent = extract(context.invocation_metadata())
        except ValueError as exc:
            await abort_invalid(context, exc)
        except NoFreeBlocks as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except EngineLoopStopped as exc:  # another worker may serve it
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except asyncio.CancelledError:  # gone while the engine thread admitted it: nobody will read it
            self.engine_loop.abort(request_id)  # queued after the add, so it finds what the add left
            raise
        prefill = None
        if admission.kv_from_pos is not None:
            prefill = asyncio.create_task(self._remote_prefill(request_id, request, params, admission))
        if stream.shared is not None:
            stream.shared.bound.add(stream)
            if stream.shared.is_closed:  # it ended while this one was admitted
                stream.outputs.put_nowait(_StreamClosed())
        finished = False
        try:
            while not finished:
                output = await self._next_output(stream, context)
                if isinstance(output, _StreamClosed):
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the router's Outputs stream ended")
                finished = output.finish_reason is not None
                stages = self._finished(request_id, admission, output) if output.times is not None else None
                if output.error is not None:
                    await abort_failed(context, output)
                chunk = output_to_chunk(output, admission.num_prompt_tokens)
                if stages is not None:
                    chunk.stages.CopyFrom(stages)
                chunk.num_streamed_chunks = stream.num_streamed
                yield chunk
        finally:
            logger.info("request %s %s (prompt %d tokens, %s)", request_id, "finished" if finished else "cancelled",
                        admission.num_prompt_tokens, "local prefill" if prefill is None else "remote prefill")
            if stream.shared is not None:
                stream.shared.bound.discard(stream)
            if not finished:  # client gone, cancelled or failed: free everything it holds here
                self.engine_loop.abort(request_id)
            if prefill is not None and not prefill.done():
                prefill.cancel()  # cancels the Prefill call: the prefill worker drops it too

    async def _next_output(self, stream: _Stream, context) -> EngineCoreOutput | _StreamClosed:
        """The call's next output; a stream with no output for --stall-timeout (counting the
        chunks it sent on its Outputs stream) fails with DEADLINE_EXCEEDED."""
        stall_s, since = self.config.stall_timeout_s, time.monotonic()
        while (remaining := max(since, stream.progressed) + stall_s - time.monotonic()) > 0:
            try:
                return await asyncio.wait_for(stream.outputs.get(), remaining)
            except TimeoutError:
                pass  # its Outputs stream may have had some meanwhile
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no progress for {stall_s:g} s")

    async def Outputs(self, request: pb.OutputsRequest, context):
        """A router's stream of its requests' chunks, one message per engine step. Its Generate
        calls name it; when it ends (the router closed it, or is gone), they end too."""
        shared = _OutputsStream(uuid.uuid4().hex)
        self._outputs[shared.stream_id] = shared
        try:
            yield pb.StepOutputs(stream_id=shared.stream_id)
            while True:
                yield await shared.steps.get()
        finally:
            shared.is_closed = True
            del self._outputs[shared.stream_id]
            for stream in shared.bound:
                stream.outputs.put_nowait(_StreamClosed())

    def _finished(self, request_id: str, admission: _Admission, output: EngineCoreOutput) -> pb.StageTimes:
        """Its stage times (for the router) and, with tracing on, its spans here."""
        remote = admission.kv_from_pos is not None and not output.kv_recomputed
        stages = decode_stage_times(admission.received, admission.prefill_sent, output.times, remote)
        if self.runtime.tracing is not None:
            attributes = {"tandem.request_id": request_id, "tandem.worker": self.address,
                          "gen_ai.usage.input_tokens": admission.num_prompt_tokens,
                          "tandem.cached_tokens": output.num_cached_tokens,
                          "tandem.kv_recomputed": output.kv_recomputed}
            decode_spans(self.runtime.tracing, admission.trace_parent, admission.received, admission.prefill_sent,
                         output.times, stages, attributes, output.error)
        return stages

    def _add_request(self, request_id: str, request: pb.GenerateRequest, params, stream: _Stream) -> AddRequest:
        """Remote KV where the router named a prefill worker, else a local prefill."""
        remote = None
        # prompt logprobs need the logits of every prompt position, which only a local prefill
        # computes (the prefill worker sends KV, not logits): such requests prefill here
        if request.HasField("prefill") and params.prompt_logprobs is None and not request.resume_token_ids:
            remote = RemoteKV(request.kv_deadline_ms / 1000 or self.config.kv_deadline_s,
                              _POLICIES.get(request.kv_failure_policy, self.config.kv_failure_policy))
        return AddRequest(request_id, list(request.prompt_token_ids), params, stream.put,
                          cache_salt=request.cache_salt or None, remote_kv=remote,
                          resume_token_ids=tuple(request.resume_token_ids), priority=request.priority)

    async def _remote_prefill(self, request_id: str, request: pb.GenerateRequest, params, admission: _Admission):
        """Ask the prefill worker for the KV this worker lacks. Any failure becomes a
        TransferFailed in the inbox, where the request's policy applies."""
        target = request.prefill
        deadline_s = request.kv_deadline_ms / 1000 or self.config.kv_deadline_s
        try:
            kv_target = self._kv_receiver(target).kv_target
            call = pb.PrefillRequest(
                request_id=request_id, prompt_token_ids=request.prompt_token_ids,
                params=params_to_proto(params.with_overrides(seed=admission.seed)), cache_salt=request.cache_salt,
                kv_from_pos=admission.kv_from_pos, transport=target.transport, kv_target=kv_target,
                deadline_ms=int(deadline_s * 1000), priority=request.priority,
            )
            admission.prefill_sent = time.monotonic()
            await self._prefill_stub(target.address).Prefill(call, timeout=deadline_s,
                                                             metadata=self._metadata + inject(admission.trace_parent))
        except grpc.aio.AioRpcError as exc:
            reason = f"prefill worker {target.address}: {exc.code().name}: {exc.details()}"
            self.inbox.put(TransferFailed(request_id, reason))
        except (OSError, RuntimeError) as exc:  # a torch.distributed pair could not be set up
            self.inbox.put(TransferFailed(request_id, f"KV transport to {target.address}: {exc}"))

    def _prefill_stub(self, address: str) -> pb_grpc.PrefillWorkerStub:
        stub = self._prefill_stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            stub = self._prefill_stubs[address] = pb_grpc.PrefillWorkerStub(channel)
        return stub

    def _kv_receiver(self, target: pb.PrefillTarget) -> KVReceiver:
        """What receives the prefill worker's KV: this server's Push stream (gRPC), or this
        worker's torch.distributed pair with it (set up on first use, again after a failure)."""
        if target.transport == pb.KV_TRANSPORT_GRPC:
            return self._grpc_receiver
        receiver = self._torch_receivers.get(target.address)
        if receiver is None or not receiver.is_alive:
            cache = self.core.kv_cache.storage
            receiver = TorchDistKVReceiver(self.inbox, self.config.server.cluster_secret, cache.dtype,
                                           self._token_shape, host=self.config.server.host,
                                           timeout_s=self.config.kv_deadline_s, device=cache.device)
            self._torch_receivers[target.address] = receiver
        return receiver

    # -- Abort / Stats ------------------------------------------------------------------------
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortReply:
        found = await asyncio.wrap_future(self.engine_loop.abort(request.request_id))
        return pb.AbortReply(found=found)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.WorkerStats:
        return await answer_stats(context, self.stats)

    def stats(self) -> pb.WorkerStats:
        return self.runtime.stats(num_held_transfers=self.core.num_waiting_for_remote_kv())
