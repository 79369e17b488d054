"""Where one Prefill request's KV goes: a sink the engine feeds (KVSink), that the worker then
finishes (waits for the transfer to be handed over) or cancels (drops it at once).

- gRPC: a Push stream per request, on the worker's one channel to that decode worker.
- torch.distributed: the request's frames join the pair's single stream to that decode worker
  (one process group per pair, created on first use, replaced after a failure).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import grpc
import torch

from engine.outputs import FinishReason
from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken
from kv_transfer.grpc_transport import GrpcKVSink
from kv_transfer.session import LayerSend
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


class GrpcRequestSink(GrpcKVSink, RequestSink):
    """One request's Push stream on the worker's channel to its decode worker."""

    def __init__(self, target: str, secret: str, timeout_s: float, channel: grpc.Channel) -> None:
        super().__init__(target, secret, timeout_s=timeout_s, channel=channel)

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


# How a prefill worker makes a gRPC transfer's sink: (decode worker address, cluster secret,
# timeout, channel) -> RequestSink. PrefillWorkerConfig.grpc_sink; tests give a double of it.
GrpcSinkFactory = Callable[[str, str, float, grpc.Channel], RequestSink]


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
