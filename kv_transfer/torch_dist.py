"""KV transfer over torch.distributed point-to-point, with gloo over host memory. On GPUs the
sender copies each layer's KV to the host first (wire.encode_layer) and the receiver copies it
onto its device when it writes the blocks; an NCCL pair that keeps the bytes on the devices is
not written yet (checking it takes two GPUs).

Each sender/receiver pair gets its own two-rank process group, created when the pair first
talks (the receiver hosts the rendezvous store on a free port and tells the sender where),
and torn down when the stream ends or fails. Frames are length-prefixed: the first carries the
cluster secret (compared in constant time; a wrong one ends the pair before any KV is read),
then one wire.py frame per message (protobuf header with an xxh3 checksum, then the raw tensor bytes),
received into a byte tensor and checked before the engine sees it.
"""

from __future__ import annotations

import hmac
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken
from kv_transfer.grpc_transport import LayerSend, first_token_arrival, first_token_message
from kv_transfer.inbox import EngineInbox, KVArrival, TransferFailed
from kv_transfer.wire import CorruptChunkError, decode_chunk, encode_layer, frame, parse_frame
from proto import kv_transfer_pb2 as pb

_RECEIVER, _SENDER = 0, 1
_END = object()
# No message-size limit here, so chunks are larger than gRPC's: each chunk costs a few
# synchronous send/recv round trips, which dominate for small ones.
GLOO_CHUNK_BYTES = 16 << 20


def _send_frame(group, data: torch.Tensor, peer: int) -> None:
    """A length prefix, then the bytes (a uint8 tensor); length 0 ends the stream."""
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], peer, 0).wait()
    if data.numel():
        group.send([data], peer, 0).wait()


def _recv_frame(group, peer: int, max_bytes: int) -> torch.Tensor | None:
    length = torch.empty(1, dtype=torch.int64)
    group.recv([length], peer, 0).wait()
    size = int(length[0])
    if size == 0:
        return None
    if not 0 < size <= max_bytes:
        raise CorruptChunkError(f"frame of {size} bytes (limit {max_bytes})")
    data = torch.empty(size, dtype=torch.uint8)
    group.recv([data], peer, 0).wait()
    return data


def _bytes_tensor(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the bytes: gloo only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


@dataclass
class TransferStats:
    bytes_received: int = 0
    chunks_received: int = 0
    rejected: dict[str, str] = field(default_factory=dict)  # request id -> reason
    error: str | None = None  # why the pair ended early (auth, timeout, peer gone)


class TorchDistKVReceiver:
    """Decode side of one pair: hosts the rendezvous store, receives on its own thread, and
    puts validated KV into the engine's inbox. ``address`` is what the sender needs."""

    def __init__(self, inbox: EngineInbox, secret: str, dtype: torch.dtype, token_shape: tuple[int, int],
                 host: str = "127.0.0.1", timeout_s: float = 60.0):
        if not secret:
            raise ValueError("a cluster secret is required to accept KV")
        self._inbox, self._secret = inbox, secret.encode()
        self._dtype, self._token_shape = dtype, token_shape
        self._timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, 0, 2, True, self._timeout, wait_for_workers=False)
        self.address = (host, self._store.port)
        self.stats = TransferStats()
        self._open: dict[str, float] = {}  # request with KV on this pair but no first token yet -> first chunk's arrival
        self._thread = threading.Thread(target=self._run, name="kv-recv-gloo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            group = dist.ProcessGroupGloo(self._store, _RECEIVER, 2, self._timeout)
            secret = _recv_frame(group, _SENDER, 4096)
            if secret is None or not hmac.compare_digest(secret.numpy().tobytes(), self._secret):
                self.stats.error = "sender did not present the cluster secret"
                return  # the pair ends here: nothing of this sender is read
            while (data := _recv_frame(group, _SENDER, 2 * GLOO_CHUNK_BYTES)) is not None:
                self._handle(*parse_frame(data.numpy()))
        except (RuntimeError, CorruptChunkError) as exc:  # timeouts, dead peers, broken frames
            self.stats.error = str(exc)
        finally:  # whatever was half-sent will never complete: its requests' policy applies now
            for request_id in self._open:
                self._inbox.put(TransferFailed(request_id, f"the KV pair ended early: {self.stats.error or 'the sender closed it'}"))
            self._open.clear()

    def _handle(self, message: pb.KVMessage, payload: memoryview) -> None:
        kind = message.WhichOneof("kind")
        request_id = getattr(message, kind).request_id
        if request_id in self.stats.rejected:
            return
        if kind == "chunk":
            try:
                chunk = decode_chunk(message.chunk, payload, self._dtype, self._token_shape)
            except CorruptChunkError as exc:
                self.stats.rejected[request_id] = str(exc)
                self._open.pop(request_id, None)
                self._inbox.put(TransferFailed(request_id, str(exc)))
                return
            self._open.setdefault(request_id, time.monotonic())
            self._inbox.put(KVArrival(chunk.request_id, chunk.layer, chunk.start_pos, chunk.kv))
            self.stats.bytes_received += payload.nbytes
            self.stats.chunks_received += 1
        elif kind == "first_token":
            self._inbox.put(first_token_arrival(message.first_token, self._open.pop(request_id, None)))
        else:
            self._open.pop(request_id, None)
            self._inbox.put(TransferFailed(request_id, f"sender aborted: {message.abort.reason}"))

    @property
    def is_alive(self) -> bool:
        """False once the pair has ended (the sender finished, failed or never came)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> TransferStats:
        self._thread.join(timeout_s)
        return self.stats


class TorchDistKVSink(KVSink):
    """Prefill side of one pair: joins the receiver's group at ``address`` and streams from a
    sender thread (the engine thread only queues tensors). ``finish()`` ends the stream."""

    def __init__(self, address: tuple[str, int], secret: str, timeout_s: float = 60.0,
                 max_chunk_bytes: int = GLOO_CHUNK_BYTES):
        self._address, self._secret = address, secret
        self._timeout = timedelta(seconds=timeout_s)
        self._max_chunk_bytes = max_chunk_bytes
        self._queue: queue.Queue = queue.Queue()
        self.bytes_sent = 0
        self.error: str | None = None
        # request id -> its layers sent so far (trace spans); whoever registers a request takes them back
        self.layer_sends: dict[str, list[LayerSend]] = {}
        self._thread = threading.Thread(target=self._run, name="kv-send-gloo", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(self._address[0], self._address[1], 2, False, self._timeout)
            group = dist.ProcessGroupGloo(store, _SENDER, 2, self._timeout)
            _send_frame(group, _bytes_tensor(self._secret.encode()), _RECEIVER)
            while (item := self._queue.get()) is not _END:
                if isinstance(item, tuple):
                    started, num_bytes = time.monotonic(), 0
                    for data in encode_layer(*item, max_chunk_bytes=self._max_chunk_bytes):
                        num_bytes += parse_frame(data)[1].nbytes
                        _send_frame(group, self._frame_tensor(data), _RECEIVER)
                    self.bytes_sent += num_bytes
                    sends = self.layer_sends.get(item[0])
                    if sends is not None:
                        sends.append(LayerSend(item[1], item[2], num_bytes, started, time.monotonic()))
                else:
                    _send_frame(group, _bytes_tensor(frame(item)), _RECEIVER)
            _send_frame(group, torch.empty(0, dtype=torch.uint8), _RECEIVER)
        except RuntimeError as exc:
            self.error = str(exc)

    def _frame_tensor(self, data: bytes) -> torch.Tensor:
        """The bytes that leave for one KV frame (tests override it to corrupt them)."""
        return _bytes_tensor(data)

    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        self._queue.put((request_id, layer, start_pos, kv))

    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        self._queue.put(first_token_message(request_id, token, num_cached_tokens, timing))

    def close(self, request_id: str, finish_reason: str) -> None:
        if finish_reason not in ("stop", "length"):
            self._queue.put(pb.KVMessage(abort=pb.TransferAbort(request_id=request_id, reason=finish_reason)))

    @property
    def is_alive(self) -> bool:
        """False once the pair has ended (finished or failed): a new pair is needed."""
        return self._thread.is_alive()

    def finish(self, timeout_s: float | None = None) -> str | None:
        """End the stream and wait for it to drain; returns the error, if any."""
        self._queue.put(_END)
        self._thread.join(timeout_s if timeout_s is not None else self._timeout.total_seconds())
        return self.error
