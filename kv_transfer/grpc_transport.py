"""KV transfer over gRPC: a client-streaming Push per sender, served on the decode worker's own
grpc.aio server (whose interceptor checks the cluster secret on every call). Frames are raw
bytes (wire.py), never a protobuf copy of the payload; the stream's ReceiveSession validates
each one before anything reaches the engine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import torch

from kv_transfer.inbox import EngineInbox
from kv_transfer.session import ControlItem, KVReceiver, LayerItem, LayerSend, QueuedKVSink, ReceiveSession
from kv_transfer.wire import MAX_CHUNK_BYTES, CorruptChunkError, decode_chunk, encode_layer, frame, parse_frame
from proto import kv_transfer_pb2 as pb
from proto.rpc import CHANNEL_OPTIONS, secret_metadata

SERVICE = "tandem.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"  # client-streaming frames (wire.py) -> PushReply


class GrpcKVReceiver(KVReceiver):
    """Decode side: the Push handler, registered on the worker's server with ``handler()``.
    ``dtype`` and ``token_shape`` ([2 * kv_heads, head_dim]) describe the receiving cache;
    chunks that do not match, or fail their checksum, are rejected. ``address()`` is the
    server's host:port once it serves."""

    def __init__(self, inbox: EngineInbox, dtype: torch.dtype, token_shape: tuple[int, int],
                 address: Callable[[], str]) -> None:
        self._inbox = inbox
        self._dtype = dtype
        self._token_shape = tuple(token_shape)
        self._address = address

    @property
    def kv_target(self) -> str:
        return self._address()

    def handler(self) -> grpc.GenericRpcHandler:
        push = grpc.stream_unary_rpc_method_handler(self.push, response_serializer=pb.PushReply.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE, {"Push": push})

    async def push(self, frames, context) -> pb.PushReply:
        session = ReceiveSession(self._inbox)
        try:
            async for data in frames:
                try:
                    message, payload = parse_frame(data)
                except CorruptChunkError as exc:  # no request to blame: the stream itself is broken
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad KV frame: {exc}")
                session.accept(message, lambda chunk: decode_chunk(chunk, payload, self._dtype, self._token_shape).kv)
        finally:
            session.close("the KV stream ended before the transfer completed")
        stats = session.stats
        return pb.PushReply(bytes_received=stats.bytes_received, chunks_received=stats.chunks_received,
                            rejected=stats.rejected)


class GrpcKVSink(QueuedKVSink):
    """Prefill side: one Push stream to one decode worker. The engine thread only queues; a
    sender thread frames (header + checksum + bytes) and streams them, so layer i travels while
    layer i+1 computes. ``finish()`` ends the stream and returns the receiver's reply."""

    def __init__(self, target: str, secret: str, timeout_s: float = 60.0, max_chunk_bytes: int = MAX_CHUNK_BYTES,
                 channel: grpc.Channel | None = None):
        super().__init__()
        # a worker passes its channel to the target (one connection, many streams); else our own
        self._owns_channel = channel is None
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._push = self._channel.stream_unary(PUSH_METHOD, response_deserializer=pb.PushReply.FromString)
        self._metadata = secret_metadata(secret)
        self._timeout_s = timeout_s
        self._max_chunk_bytes = max_chunk_bytes
        self.bytes_sent = 0
        self.reply: pb.PushReply | None = None
        self.error: grpc.RpcError | None = None
        self.cancelled = False
        self.layer_sends: list[LayerSend] = []
        self._call: grpc.Future | None = None
        self._thread = threading.Thread(target=self._run, name="kv-push", daemon=True)
        self._thread.start()

    def _frames(self) -> Iterator[bytes]:
        while (item := self.next_item()) is not None:
            match item:
                case LayerItem(request_id, layer, start_pos, kv):
                    started = time.monotonic()
                    yield from encode_layer(request_id, layer, start_pos, kv, self._max_chunk_bytes)
                    num_bytes = kv.numel() * kv.element_size()
                    self.bytes_sent += num_bytes
                    self.layer_sends.append(LayerSend(layer, start_pos, num_bytes, started, time.monotonic()))
                case ControlItem(message):
                    yield frame(message)

    def _run(self) -> None:
        try:
            self._call = self._push.future(self._frames(), metadata=self._metadata, timeout=self._timeout_s)
            self.reply = self._call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as exc:
            self.error = exc if isinstance(exc, grpc.RpcError) else None
            self.cancelled = isinstance(exc, grpc.FutureCancelledError)
        finally:  # the stream is over: queued tensors are released, never sent
            self.drop_queued()

    def cancel(self) -> None:
        """Drop the stream now (the receiver sees it end and fails what it did not complete)."""
        self.cancelled = True
        if self._call is not None:
            self._call.cancel()
        self.end_stream()

    def finish(self, timeout_s: float | None = None) -> pb.PushReply | None:
        """End the stream, wait for the reply (None on error; see ``error``)."""
        self.end_stream()
        self._thread.join(timeout_s if timeout_s is not None else self._timeout_s)
        if self._owns_channel:
            self._channel.close()
        return self.reply
