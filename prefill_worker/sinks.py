"""Where one Prefill request's KV goes: a sink the engine feeds (KVSink), that the worker then
finishes (waits for the transfer to be handed over) or cancels (drops it at once).

- gRPC: a Push stream per request, on the worker's one channel to that decode worker.
- torch.distributed: the request's frames join the pair's single stream to that decode worker
  (one process group per pair, created on first use, replaced after a failure).
"""

from __future__ import annotations

import threading
from abc import abstractmethod

import grpc
import torch

from engine.outputs import FinishReason
from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken
from kv_transfer.grpc_transport import GrpcKVSink
from kv_transfer.session import LayerItem, LayerSend, SendItem
from kv_transfer.torch_dist import TorchDistKVSink


class RequestSink(KVSink):
    bytes_sent: int
    layer_sends: list[LayerSend]  # what left so far, layer by layer (trace spans)

    @abstractmethod
    def finish(self, timeout_s: float) -> str | None:
        """Wait (at most ``timeout_s``) until the KV is handed over; the error, or None."""

    @abstractmethod
    def cancel(self) -> None:
        """Drop the transfer now; never blocks. Idempotent."""


class FramePause:
    """Test hook (Ray actor method ``arm_kv_pause``): the next gRPC transfer holds its sender
    after ``after_layers`` layers of KV, as a stalled prefill worker would, until released
    (cancel, ``release``) or its deadline. ``holding`` is set while a sender is held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._after_layers: int | None = None
        self._release = threading.Event()
        self.holding = threading.Event()

    def arm(self, after_layers: int) -> None:
        with self._lock:
            self._after_layers = after_layers
            self._release.clear()
            self.holding.clear()

    def claim(self) -> int | None:
        with self._lock:
            after, self._after_layers = self._after_layers, None
            return after

    def hold(self, timeout_s: float) -> None:
        self.holding.set()
        self._release.wait(timeout_s)

    def release(self) -> None:
        self._release.set()


class _GrpcRequestSink(GrpcKVSink, RequestSink):
    def __init__(self, target: str, secret: str, timeout_s: float, channel: grpc.Channel, pause: FramePause):
        self._pause = pause
        self._hold_after = pause.claim()
        self._num_layers = 0
        super().__init__(target, secret, timeout_s=timeout_s, channel=channel)

    def next_item(self) -> SendItem | None:  # the sender thread
        item = super().next_item()
        if isinstance(item, LayerItem) and self._hold_after is not None:
            self._num_layers += 1
            if self._num_layers > self._hold_after:
                self._pause.hold(self._timeout_s)
        return item

    def finish(self, timeout_s: float) -> str | None:
        reply = super().finish(timeout_s)
        if self.cancelled:
            return "the transfer was cancelled"
        if self.error is not None:
            return f"{self.error.code().name}: {self.error.details()}"
        if reply is None:
            return "the KV stream did not finish in time"
        if reply.rejected:
            return "the decode worker refused it: " + "; ".join(reply.rejected.values())
        return None

    def cancel(self) -> None:
        super().cancel()
        if self._hold_after is not None:
            self._pause.release()


def grpc_request_sink(target: str, secret: str, timeout_s: float, channel: grpc.Channel,
                      pause: FramePause) -> RequestSink:
    return _GrpcRequestSink(target, secret, timeout_s, channel, pause)


class _PairRequestSink(RequestSink):
    """One request on a shared torch.distributed pair: forwards to the pair, counts its bytes.
    Delivery is confirmed by the decode worker's own verification, not here."""

    def __init__(self, pair: TorchDistKVSink, request_id: str) -> None:
        self._pair = pair
        self._request_id = request_id
        self.bytes_sent = 0
        self.layer_sends = pair.layer_sends.setdefault(request_id, [])

    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        self.bytes_sent += kv.numel() * kv.element_size()
        self._pair.send_layer(request_id, layer, start_pos, kv)

    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        self._pair.send_first_token(request_id, token, num_cached_tokens, timing)

    def close(self, request_id: str, finish_reason: FinishReason) -> None:
        self._pair.close(request_id, finish_reason)

    def finish(self, timeout_s: float) -> str | None:
        return self._pair.error

    def cancel(self) -> None:
        # the engine's abort already queued a TransferAbort on the pair; stop recording its sends
        self._pair.layer_sends.pop(self._request_id, None)


def torch_request_sink(pair: TorchDistKVSink, request_id: str) -> RequestSink:
    return _PairRequestSink(pair, request_id)
