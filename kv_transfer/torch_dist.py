"""KV transfer over torch.distributed point-to-point.

Each sender/receiver pair gets its own two-rank process group, created when the pair first
talks (the receiver hosts the rendezvous store on a free port and tells the sender where),
and torn down when the stream ends or fails. Two channels share the store:

- control, always gloo over host memory: length-prefixed frames. The first carries the cluster
  secret (compared in constant time; a wrong one ends the pair before any KV is read), then
  one wire.py header per message (chunk headers, first tokens, aborts), never a payload;
- payload: each chunk's KV bytes, sent right after its header as one uint8 tensor. Where both
  ends hold their KV cache on CUDA this is an NCCL group, and the bytes go device to device
  without touching host memory; otherwise it is the gloo group, in host memory.

Both ends publish their KV device in the store and pick the payload backend from the pair
(``payload_backend``), so they always agree. A chunk's checksum is computed where its bytes
are (``CHECKSUMS``: xxh3 in host memory, ``payload_checksum`` on the GPU) and checked before the
engine sees them. Checking NCCL takes two GPUs; here the same code runs with gloo for both
channels, and a test runs it with the GPU's checksum.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import xxhash

from kv_transfer.inbox import EngineInbox
from kv_transfer.session import (
    ControlItem,
    KVReceiver,
    LayerItem,
    LayerSend,
    QueuedKVSink,
    ReceiveSession,
    ReceiveStats,
)
from kv_transfer.wire import (
    CorruptChunkError,
    check_chunk_header,
    chunk_header,
    chunk_parts,
    frame,
    parse_frame,
)
from proto import kv_transfer_pb2 as pb

_RECEIVER, _SENDER = 0, 1
# No message-size limit here, so chunks are larger than gRPC's: each chunk costs a few
# synchronous send/recv round trips, which dominate for small ones.
GLOO_CHUNK_BYTES = 16 << 20
_HEADER_LIMIT = 1 << 16
_MASK = (1 << 64) - 1


def payload_backend(sender_device: str, receiver_device: str) -> str:
    """NCCL when both KV caches are on CUDA, else gloo (host memory)."""
    return "nccl" if sender_device == receiver_device == "cuda" else "gloo"


def payload_checksum(data: torch.Tensor) -> int:
    """A 64-bit checksum of a uint8 tensor, computed on its own device with integer torch ops
    (the same value on the CPU and on CUDA): over the bytes as int32 words w_i (zero-padded),
    s1 = sum(w_i) and s2 = sum((i + 1) * w_i), both mod 2**64, mixed into one number. Any
    change of one word changes s1; moving words around changes s2. Not a defence against a
    forger (the cluster secret is); it catches damaged or misplaced bytes."""
    flat = data.reshape(-1)
    pad = (-flat.numel()) % 4
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int32).to(torch.int64)
    index = torch.arange(1, words.numel() + 1, dtype=torch.int64, device=words.device)
    s1 = int(words.sum()) & _MASK
    s2 = int((words * index).sum()) & _MASK
    return (s2 * 0x9E3779B97F4A7C15 + s1 + words.numel()) & _MASK


def _xxh3(data: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()))


# the chunk checksum per payload backend: xxh3 on host bytes (tens of GB/s on a CPU); on the
# GPU, payload_checksum where the bytes are, so that they never cross to the host
CHECKSUMS = {"gloo": _xxh3, "nccl": payload_checksum}


def _wait(work, nccl: bool, deadline: float, what: str) -> None:
    """Wait for a point-to-point op: gloo's wait blocks (under the group's timeout); an NCCL
    op is polled until it completes or the deadline passes."""
    if not nccl:
        work.wait()
        return
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError(f"NCCL {what} did not complete in time")
        time.sleep(0.0005)


def local_address_to(host: str) -> str:
    """The address this machine sends from to reach ``host`` (the kernel's route; no packet
    is sent)."""
    family, _, _, _, target = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return probe.getsockname()[0]


def _gloo_group(store, rank: int, timeout: timedelta, host: str) -> dist.ProcessGroupGloo:
    """A two-rank gloo group whose sockets are on ``host``. Gloo's own default is the address
    the machine's hostname resolves to, which another node (a network namespace, a pod) may
    not reach, or which may not be this one's at all."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, 2, options)


class _Pair:
    """One end of a pair: the control group (gloo) and the payload group (gloo or NCCL).
    ``host``: this end's address, the one its peer reaches."""

    def __init__(self, store, rank: int, timeout: timedelta, own_device: torch.device, host: str):
        self.rank, self.peer = rank, 1 - rank
        self.timeout_s = timeout.total_seconds()
        self.control = _gloo_group(dist.PrefixStore("control", store), rank, timeout, host)
        store.set(f"device{rank}", own_device.type)
        peer_device = store.get(f"device{self.peer}").decode()
        sender, receiver = (own_device.type, peer_device) if rank == _SENDER else (peer_device, own_device.type)
        self.backend = payload_backend(sender, receiver)
        self.payload_device = own_device if self.backend == "nccl" else torch.device("cpu")
        self.checksum = CHECKSUMS[self.backend]
        if self.backend == "nccl":
            torch.cuda.set_device(own_device)
            self.payload = dist.ProcessGroupNCCL(dist.PrefixStore("payload", store), rank, 2)
        else:
            self.payload = self.control

    def send_frame(self, data: torch.Tensor) -> None:
        """A length prefix, then the bytes (a host uint8 tensor); length 0 ends the stream."""
        self.control.send([torch.tensor([data.numel()], dtype=torch.int64)], self.peer, 0).wait()
        if data.numel():
            self.control.send([data], self.peer, 0).wait()

    def recv_frame(self, max_bytes: int) -> torch.Tensor | None:
        length = torch.empty(1, dtype=torch.int64)
        self.control.recv([length], self.peer, 0).wait()
        size = int(length[0])
        if size == 0:
            return None
        if not 0 < size <= max_bytes:
            raise CorruptChunkError(f"frame of {size} bytes (limit {max_bytes})")
        data = torch.empty(size, dtype=torch.uint8)
        self.control.recv([data], self.peer, 0).wait()
        return data

    def send_payload(self, data: torch.Tensor) -> None:
        """``data``: a uint8 tensor on ``payload_device``."""
        work = self.payload.send([data], self.peer, 1)
        _wait(work, self.backend == "nccl", time.monotonic() + self.timeout_s, "send")

    def recv_payload(self, num_bytes: int) -> torch.Tensor:
        data = torch.empty(num_bytes, dtype=torch.uint8, device=self.payload_device)
        work = self.payload.recv([data], self.peer, 1)
        _wait(work, self.backend == "nccl", time.monotonic() + self.timeout_s, "receive")
        return data


def _bytes_tensor(data: bytes) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view of the bytes: gloo only reads it
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


@dataclass(slots=True)
class TransferStats(ReceiveStats):
    error: str | None = None  # why the pair ended early (auth, timeout, peer gone)
    backend: str | None = None  # the payload channel's: gloo or nccl


class TorchDistKVReceiver(KVReceiver):
    """Decode side of one pair: hosts the rendezvous store, receives on its own thread, and
    puts validated KV into the engine's inbox. ``address`` (host, port) is what the sender
    needs. ``device``: where this engine's KV cache lives (CUDA on both ends: payloads over
    NCCL)."""

    def __init__(self, inbox: EngineInbox, secret: str, dtype: torch.dtype, token_shape: tuple[int, int],
                 host: str = "127.0.0.1", timeout_s: float = 60.0, device: torch.device | str = "cpu",
                 max_chunk_bytes: int = 2 * GLOO_CHUNK_BYTES):
        if not secret:
            raise ValueError("a cluster secret is required to accept KV")
        self._inbox, self._secret = inbox, secret.encode()
        self._dtype, self._token_shape = dtype, token_shape
        self._device = torch.device(device)
        self._max_chunk_bytes = max_chunk_bytes
        self._timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, 0, 2, True, self._timeout, wait_for_workers=False)
        self.address = (host, self._store.port)
        self.stats = TransferStats()
        self._session = ReceiveSession(inbox, self.stats)
        self._thread = threading.Thread(target=self._run, name="kv-recv-torch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            pair = _Pair(self._store, _RECEIVER, self._timeout, self._device, self.address[0])
            self.stats.backend = pair.backend
            secret = pair.recv_frame(4096)
            if secret is None or not hmac.compare_digest(secret.numpy().tobytes(), self._secret):
                self.stats.error = "sender did not present the cluster secret"
                return  # the pair ends here: nothing of this sender is read
            while (data := pair.recv_frame(_HEADER_LIMIT)) is not None:
                message, payload = parse_frame(data.numpy())
                if payload.nbytes:
                    raise CorruptChunkError("a control frame carries payload bytes")
                self._accept(pair, message)
        except (RuntimeError, CorruptChunkError) as exc:  # timeouts, dead peers, broken frames
            self.stats.error = str(exc)
        finally:  # whatever was half-sent will never complete: its requests' policy applies now
            self._session.close(f"the KV pair ended early: {self.stats.error or 'the sender closed it'}")

    def _accept(self, pair: _Pair, message: pb.KVMessage) -> None:
        payload = None
        if message.WhichOneof("kind") == "chunk":  # its bytes follow on the payload channel: take them now
            num_bytes = message.chunk.payload_bytes
            if not 0 < num_bytes <= self._max_chunk_bytes:  # the stream cannot be followed past this
                raise CorruptChunkError(f"chunk of {num_bytes} payload bytes (limit {self._max_chunk_bytes})")
            payload = pair.recv_payload(num_bytes)

        def read_kv(chunk: pb.KVChunk) -> torch.Tensor:
            shape = check_chunk_header(chunk, self._dtype, self._token_shape)
            if pair.checksum(payload) != chunk.checksum:
                raise CorruptChunkError("payload checksum mismatch")
            return payload.view(self._dtype).view(shape)

        self._session.accept(message, read_kv)

    @property
    def kv_target(self) -> str:
        host, port = self.address
        return f"{host}:{port}"

    @property
    def is_alive(self) -> bool:
        """False once the pair has ended (the sender finished, failed or never came)."""
        return self._thread.is_alive()

    def join(self, timeout_s: float | None = None) -> TransferStats:
        self._thread.join(timeout_s)
        return self.stats


class TorchDistKVSink(QueuedKVSink):
    """Prefill side of one pair: joins the receiver's group at ``address`` and streams from a
    sender thread (the engine thread only queues tensors). ``finish()`` ends the stream.
    ``device``: where this engine's KV cache lives (CUDA on both ends: payloads over NCCL)."""

    def __init__(self, address: tuple[str, int], secret: str, timeout_s: float = 60.0,
                 max_chunk_bytes: int = GLOO_CHUNK_BYTES, device: torch.device | str = "cpu"):
        super().__init__()
        self._address, self._secret = address, secret
        self._timeout = timedelta(seconds=timeout_s)
        self._max_chunk_bytes = max_chunk_bytes
        self._device = torch.device(device)
        self.bytes_sent = 0
        self.error: str | None = None
        self.backend: str | None = None  # the payload channel's, once the pair is up
        # request id -> its layers sent so far (trace spans); whoever registers a request takes them back
        self.layer_sends: dict[str, list[LayerSend]] = {}
        self._thread = threading.Thread(target=self._run, name="kv-send-torch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = dist.TCPStore(self._address[0], self._address[1], 2, False, self._timeout)
            pair = _Pair(store, _SENDER, self._timeout, self._device, local_address_to(self._address[0]))
            self.backend = pair.backend
            pair.send_frame(_bytes_tensor(self._secret.encode()))
            while (item := self.next_item()) is not None:
                match item:
                    case LayerItem():
                        self._send_layer(pair, item)
                    case ControlItem(message):
                        pair.send_frame(_bytes_tensor(frame(message)))
            pair.send_frame(torch.empty(0, dtype=torch.uint8))
        except (RuntimeError, OSError) as exc:  # timeouts, dead peers, no route to the receiver
            self.error = str(exc)
        finally:
            self.drop_queued()

    def _send_layer(self, pair: _Pair, item: LayerItem) -> None:
        request_id, layer, start_pos = item.request_id, item.layer, item.start_pos
        started, num_bytes = time.monotonic(), 0
        for offset, part in chunk_parts(item.kv, self._max_chunk_bytes):
            payload = part.to(pair.payload_device).view(torch.uint8).reshape(-1)
            header = chunk_header(request_id, layer, start_pos + offset, part, pair.checksum(payload))
            pair.send_frame(_bytes_tensor(frame(header)))
            pair.send_payload(payload)
            num_bytes += payload.numel()
        self.bytes_sent += num_bytes
        sends = self.layer_sends.get(request_id)
        if sends is not None:
            sends.append(LayerSend(layer, start_pos, num_bytes, started, time.monotonic()))

    @property
    def is_alive(self) -> bool:
        """False once the pair has ended (finished or failed): a new pair is needed."""
        return self._thread.is_alive()

    def finish(self, timeout_s: float | None = None) -> str | None:
        """End the stream and wait for it to drain; returns the error, if any."""
        self.end_stream()
        self._thread.join(timeout_s if timeout_s is not None else self._timeout.total_seconds())
        return self.error
