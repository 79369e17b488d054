"""KV transfer over gRPC: a client-streaming Push from the prefill side, a servicer on the
decode side. The sender authenticates with the cluster secret in call metadata; the receiver
compares it in constant time and validates every chunk before anything reaches the engine."""

from __future__ import annotations

import hmac
import queue
import threading
import time
from concurrent import futures
from dataclasses import dataclass

import grpc
import torch

from engine.engine_core import KVLanding
from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken, TokenLogprobs
from kv_transfer.inbox import EngineInbox, FirstTokenArrival, KVArrival, TransferFailed
from kv_transfer.wire import (
    MAX_CHUNK_BYTES,
    CorruptChunkError,
    decode_chunk,
    encode_layer,
    frame,
    parse_frame,
)
from proto import kv_transfer_pb2 as pb
from proto.rpc import CHANNEL_OPTIONS, SECRET_METADATA_KEY, secret_metadata

PUSH_METHOD = "/tandem.v1.KVTransfer/Push"  # client-streaming frames (wire.py) -> PushReply
_END = object()


class KVTransferServicer:
    """Decode side. ``dtype`` and ``token_shape`` ([2 * kv_heads, head_dim]) describe the
    receiving cache; chunks that do not match, or fail their checksum, are rejected."""

    def __init__(self, inbox: EngineInbox, secret: str, dtype: torch.dtype, token_shape: tuple[int, int]):
        if not secret:
            raise ValueError("a cluster secret is required to accept KV")
        self._inbox = inbox
        self._secret = secret.encode()
        self._dtype = dtype
        self._token_shape = token_shape

    def _authorized(self, context) -> bool:
        sent = dict(context.invocation_metadata()).get(SECRET_METADATA_KEY, "")
        return hmac.compare_digest(sent.encode(), self._secret)

    def push(self, frames, context) -> pb.PushReply:
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster secret")
        stream = _PushStream(self._inbox, self._dtype, self._token_shape)
        try:
            for data in frames:
                try:
                    stream.accept(data)
                except CorruptChunkError as exc:  # no request to blame: the stream itself is broken
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV frame: {exc}")
        finally:
            stream.close()
        return stream.reply

    async def push_async(self, frames, context) -> pb.PushReply:
        """The same on a grpc.aio server (the worker's; it checks the secret for every call)."""
        stream = _PushStream(self._inbox, self._dtype, self._token_shape)
        try:
            async for data in frames:
                try:
                    stream.accept(data)
                except CorruptChunkError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV frame: {exc}")
        finally:
            stream.close()
        return stream.reply

    def aio_handler(self) -> grpc.GenericRpcHandler:
        push = grpc.stream_unary_rpc_method_handler(self.push_async, response_serializer=pb.PushReply.SerializeToString)
        return grpc.method_handlers_generic_handler("tandem.v1.KVTransfer", {"Push": push})

    def handler(self) -> grpc.GenericRpcHandler:
        """Frames arrive as raw bytes (no protobuf copy of the payload); the reply is protobuf."""
        push = grpc.stream_unary_rpc_method_handler(self.push, response_serializer=pb.PushReply.SerializeToString)
        return grpc.method_handlers_generic_handler("tandem.v1.KVTransfer", {"Push": push})


class _PushStream:
    """One Push call on the receiver: validates frames into the inbox, and when the stream
    ends (cleanly or not), fails the requests it started but never completed, so the
    decode worker reacts at once instead of at the deadline."""

    def __init__(self, inbox: EngineInbox, dtype: torch.dtype, token_shape: tuple[int, int]) -> None:
        self._inbox, self._dtype, self._token_shape = inbox, dtype, token_shape
        self._open: dict[str, float] = {}  # request id with KV here but no first token yet -> its first chunk's arrival
        self.rejected: dict[str, str] = {}
        self.reply = pb.PushReply()

    def accept(self, data) -> None:
        message, payload = parse_frame(data)  # CorruptChunkError: the stream is broken
        inbox = self._inbox
        kind = message.WhichOneof("kind")
        request_id = getattr(message, kind).request_id
        if request_id in self.rejected:
            return
        if kind == "chunk":
            try:
                chunk = decode_chunk(message.chunk, payload, self._dtype, self._token_shape)
            except CorruptChunkError as exc:
                self.rejected[request_id] = str(exc)
                self.reply.rejected[request_id] = str(exc)
                self._open.pop(request_id, None)
                inbox.put(TransferFailed(request_id, str(exc)))
                return
            self._open.setdefault(request_id, time.monotonic())
            inbox.put(KVArrival(chunk.request_id, chunk.layer, chunk.start_pos, chunk.kv))
            self.reply.bytes_received += payload.nbytes
            self.reply.chunks_received += 1
        elif kind == "first_token":
            inbox.put(first_token_arrival(message.first_token, self._open.pop(request_id, None)))
        else:
            self._open.pop(request_id, None)
            inbox.put(TransferFailed(request_id, f"sender aborted: {message.abort.reason}"))

    def close(self) -> None:
        for request_id in self._open:
            self._inbox.put(TransferFailed(request_id, "the KV stream ended before the transfer completed"))
        self._open.clear()


def first_token_message(request_id: str, token: SampledToken, num_cached_tokens: int,
                        timing: PrefillTiming = PrefillTiming()) -> pb.KVMessage:
    first = pb.FirstToken(request_id=request_id, token_id=token.token_id, num_cached_tokens=num_cached_tokens,
                          queue_seconds=timing.queue_s, prefill_seconds=timing.prefill_s)
    if token.logprobs is not None:
        first.logprob_token_ids.extend(token.logprobs.token_ids)
        first.logprobs.extend(token.logprobs.logprobs)
        first.ranks.extend(token.logprobs.ranks)
    return pb.KVMessage(first_token=first)


def first_token_arrival(first: pb.FirstToken, first_chunk_at: float | None) -> FirstTokenArrival:
    """A FirstToken message that just landed, as the engine inbox takes it."""
    logprobs = None
    if first.logprob_token_ids:
        logprobs = TokenLogprobs(list(first.logprob_token_ids), list(first.logprobs), list(first.ranks))
    sender = PrefillTiming(max(0.0, first.queue_seconds), max(0.0, first.prefill_seconds))
    return FirstTokenArrival(first.request_id, SampledToken(first.token_id, logprobs), first.num_cached_tokens,
                             KVLanding(time.monotonic(), first_chunk_at, sender))


@dataclass(frozen=True, slots=True)
class LayerSend:
    """One layer's KV for one request leaving a sender (for its trace span)."""

    layer: int
    start_pos: int
    num_bytes: int
    started: float  # time.monotonic(): taken off the send queue
    ended: float  # its last frame was handed to the transport


def start_kv_server(servicer: KVTransferServicer, host: str = "127.0.0.1", port: int = 0, workers: int = 4):
    """Serve KVTransfer; returns (server, bound port). Port 0 picks a free one."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((servicer.handler(),))
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"could not bind the KV transfer server to {host}:{port}")
    server.start()
    return server, bound


class GrpcKVSink(KVSink):
    """Prefill side: one Push stream to one decode worker. The engine thread only queues
    tensors; a sender thread frames (header + checksum + bytes) and streams them, so layer i travels
    while layer i+1 computes. ``finish()`` ends the stream and returns the receiver's reply."""

    def __init__(self, target: str, secret: str, timeout_s: float = 60.0, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 channel: grpc.Channel | None = None):
        # a worker passes its channel to the target (one connection, many streams); else our own
        self._owns_channel = channel is None
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._push = self._channel.stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)
        self._metadata = secret_metadata(secret)
        self._timeout_s = timeout_s
        self._max_chunk_bytes = max_chunk_bytes
        self._queue: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.reply: pb.PushReply | None = None
        self.error: grpc.RpcError | None = None
        self.cancelled = False
        self.layer_sends: list[LayerSend] = []
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name="kv-push", daemon=True)
        self._thread.start()

    def _messages(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, tuple):  # (request id, layer, start, kv)
                started = time.monotonic()
                for data in encode_layer(*item, max_chunk_bytes=self._max_chunk_bytes):
                    yield self._on_frame(data)
                kv = item[3]
                self.layer_sends.append(LayerSend(item[1], item[2], kv.numel() * kv.element_size(), started,
                                                  time.monotonic()))
            else:
                yield frame(item)

    def _on_frame(self, data: bytes) -> bytes:
        """Every KV frame passes here before it leaves (tests override it)."""
        message, payload = parse_frame(data)
        self.bytes_sent += payload.nbytes
        return data

    def _run(self) -> None:
        try:
            self._call = self._push.future(self._messages(), metadata=self._metadata, timeout=self._timeout_s)
            self.reply = self._call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            self.error = exc if isinstance(exc, grpc.RpcError) else None
            self.cancelled = isinstance(exc, grpc.FutureCancelledError)
        finally:  # the stream is over: queued tensors are released, never sent
            while not self._queue.empty():
                self._queue.get_nowait()

    def cancel(self) -> None:
        """Drop the stream now (the receiver sees it end and fails what it did not complete)."""
        self.cancelled = True
        if self._call is not None:
            self._call.cancel()
        self._queue.put(_END)

    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        self._queue.put((request_id, layer, start_pos, kv))

    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        self._queue.put(first_token_message(request_id, token, num_cached_tokens, timing))

    def close(self, request_id: str, finish_reason: str) -> None:
        if finish_reason not in ("stop", "length"):  # the receiver must not wait for this one
            self._queue.put(pb.KVMessage(abort=pb.TransferAbort(request_id=request_id, reason=finish_reason)))

    def finish(self, timeout_s: float | None = None) -> pb.PushReply | None:
        """End the stream, wait for the reply (None on error; see ``error``)."""
        self._queue.put(_END)
        self._thread.join(timeout_s if timeout_s is not None else self._timeout_s)
        if self._owns_channel:
            self._channel.close()
        return self.reply
