"""The KV protocol's halves that every transport shares. gRPC and torch.distributed only move
bytes; what a stream means is decided here, once:

- sending: ``QueuedKVSink`` is the engine's ``KVSink`` for a transport with a sender thread.
  The engine thread only queues typed items (``LayerItem``, ``ControlItem``); the transport's
  thread takes them off with ``next_item`` and moves their bytes.
- receiving: a ``KVReceiver`` accepts streams; each stream (a gRPC Push call, a
  torch.distributed pair) has one ``ReceiveSession``, which validates every message before
  the engine's inbox gets it, and when the stream ends fails the transfers it started but
  never completed, so that the decode worker reacts at once instead of at the deadline.
"""

from __future__ import annotations

import abc
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.engine_core import KVLanding
from engine.outputs import FinishReason
from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken, TokenLogprobs
from kv_transfer.inbox import EngineInbox, FirstTokenArrival, KVArrival, TransferFailed
from kv_transfer.wire import CorruptChunkError
from proto import kv_transfer_pb2 as pb

# -- sending --------------------------------------------------------------------------------
# One layer's KV of one request, for positions [start_pos, start_pos + num_tokens): what a
# sender queues is what the receiver's inbox gets, field for field.
LayerItem = KVArrival


@dataclass(frozen=True, slots=True)
class ControlItem:
    """A message without payload: a request's first token, or its abort."""

    message: pb.KVMessage


SendItem = LayerItem | ControlItem


@dataclass(frozen=True, slots=True)
class LayerSend:
    """One layer's KV for one request leaving a sender (for its trace span)."""

    layer: int
    start_pos: int
    num_bytes: int
    started: float  # time.monotonic(): taken off the send queue
    ended: float  # its last byte was handed to the transport


class QueuedKVSink(KVSink):
    """A KVSink whose engine-thread calls only queue: the transport's sender thread calls
    ``next_item`` until it returns None (the stream is over: ``end_stream`` was called)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[SendItem | None] = queue.SimpleQueue()

    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        self._queue.put(LayerItem(request_id, layer, start_pos, kv))

    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        self._queue.put(ControlItem(first_token_message(request_id, token, num_cached_tokens, timing)))

    def close(self, request_id: str, finish_reason: FinishReason) -> None:
        if finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):  # the receiver must not wait for it
            abort = pb.TransferAbort(request_id=request_id, reason=str(finish_reason))
            self._queue.put(ControlItem(pb.KVMessage(abort=abort)))

    def end_stream(self) -> None:
        """No more items: the sender thread ends the stream once it has sent what is queued."""
        self._queue.put(None)

    def next_item(self) -> SendItem | None:
        """Sender thread: the next item to send (blocks); None ends the stream."""
        return self._queue.get()

    def drop_queued(self) -> None:
        """Sender thread, once the stream is over: release what will never be sent."""
        while not self._queue.empty():
            self._queue.get_nowait()


def first_token_message(request_id: str, token: SampledToken, num_cached_tokens: int,
                        timing: PrefillTiming = PrefillTiming()) -> pb.KVMessage:
    first = pb.FirstToken(request_id=request_id, token_id=token.token_id, num_cached_tokens=num_cached_tokens,
                          queue_seconds=timing.queue_s, prefill_seconds=timing.prefill_s)
    if token.logprobs is not None:
        first.logprob_token_ids.extend(token.logprobs.token_ids)
        first.logprobs.extend(token.logprobs.logprobs)
        first.ranks.extend(token.logprobs.ranks)
    return pb.KVMessage(first_token=first)


# -- receiving ------------------------------------------------------------------------------
class KVReceiver(abc.ABC):
    """The decode side of a transport, paired with the prefill side's ``KVSink``. It accepts
    streams from senders on its own thread (or event loop) and puts what they carry, validated
    by a ``ReceiveSession`` per stream, into the engine's ``EngineInbox``; the engine loop
    drains the inbox between steps, so a receiver never touches the engine. Requests whose
    stream ends early get a ``TransferFailed`` at once."""

    @property
    @abc.abstractmethod
    def kv_target(self) -> str:
        """Where a sender is told to send (``PrefillRequest.kv_target``), host:port."""

    @property
    def is_alive(self) -> bool:
        """False once it accepts no more streams (a new receiver is needed)."""
        return True


@dataclass(slots=True)
class ReceiveStats:
    bytes_received: int = 0
    chunks_received: int = 0
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> why its KV was refused


# A transport's reader of one chunk's payload: validates it against the header and the
# receiving cache (raises CorruptChunkError) and returns it as KV [num_tokens, 2 * kv_heads, head_dim].
ReadKV = Callable[[pb.KVChunk], torch.Tensor]


class ReceiveSession:
    """One stream on the receiver. ``accept`` each message in arrival order (one thread),
    ``close`` when the stream ends, however it ends."""

    def __init__(self, inbox: EngineInbox, stats: ReceiveStats | None = None) -> None:
        self._inbox = inbox
        self._open: dict[str, float] = {}  # request with KV here but no first token yet -> its first chunk's arrival
        self.stats = stats if stats is not None else ReceiveStats()  # counted into

    def accept(self, message: pb.KVMessage, read_kv: ReadKV) -> None:
        kind = message.WhichOneof("kind")
        request_id = getattr(message, kind).request_id
        if request_id in self.stats.rejected:
            return  # given up on: later pieces are dropped
        if kind == "chunk":
            try:
                kv = read_kv(message.chunk)
            except CorruptChunkError as exc:
                self._fail(request_id, str(exc))
                self.stats.rejected[request_id] = str(exc)
                return
            self._open.setdefault(request_id, time.monotonic())
            self._inbox.put(KVArrival(request_id, message.chunk.layer, message.chunk.start_pos, kv))
            self.stats.bytes_received += message.chunk.payload_bytes
            self.stats.chunks_received += 1
        elif kind == "first_token":
            self._inbox.put(_first_token_arrival(message.first_token, self._open.pop(request_id, None)))
        else:
            self._fail(request_id, f"sender aborted: {message.abort.reason}")

    def close(self, why: str) -> None:
        """The stream ended: transfers it started and never completed fail now, for ``why``."""
        for request_id in self._open:
            self._inbox.put(TransferFailed(request_id, why))
        self._open.clear()

    def _fail(self, request_id: str, reason: str) -> None:
        self._open.pop(request_id, None)
        self._inbox.put(TransferFailed(request_id, reason))


def _first_token_arrival(first: pb.FirstToken, first_chunk_at: float | None) -> FirstTokenArrival:
    """A FirstToken message that just landed, as the engine inbox takes it."""
    logprobs = None
    if first.logprob_token_ids:
        logprobs = TokenLogprobs(list(first.logprob_token_ids), list(first.logprobs), list(first.ranks))
    sender = PrefillTiming(max(0.0, first.queue_seconds), max(0.0, first.prefill_seconds))
    return FirstTokenArrival(first.request_id, SampledToken(first.token_id, logprobs), first.num_cached_tokens,
                             KVLanding(time.monotonic(), first_chunk_at, sender))
