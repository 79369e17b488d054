"""A test double of the prefill worker's gRPC sink factory (``PrefillWorkerConfig.grpc_sink``):
once armed, the next transfer's sender holds after a given number of layers of KV, as a
stalled prefill worker would, until the transfer is cancelled, the test releases it, or its
deadline passes. The worker runs in a Ray actor, another process: the test arms and watches
it through files in a folder both can see (one host)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from kv_transfer.session import LayerItem
from prefill_worker.sinks import GrpcRequestSink


@dataclass(frozen=True)
class KVPause:
    folder: str

    # -- the test's side ------------------------------------------------------------------------
    def arm(self, after_layers: int) -> None:
        """Hold the next gRPC transfer after ``after_layers`` layers."""
        for name in ("holding", "release"):
            (Path(self.folder) / name).unlink(missing_ok=True)
        staged = Path(self.folder) / f".armed-{uuid.uuid4().hex}"
        staged.write_text(str(after_layers))
        staged.rename(Path(self.folder) / "armed")  # atomic: the worker never reads half of it

    def holding(self) -> bool:
        """Whether a sender has been held since the last ``arm``."""
        return (Path(self.folder) / "holding").exists()

    def release(self) -> None:
        (Path(self.folder) / "release").touch()

    # -- the worker's side: the factory ---------------------------------------------------------
    def __call__(self, target: str, secret: str, timeout_s: float, channel) -> GrpcRequestSink:
        after = self._claim()
        if after is None:
            return GrpcRequestSink(target, secret, timeout_s, channel)
        return _PausingSink(target, secret, timeout_s, channel, self, after)

    def _claim(self) -> int | None:
        claimed = Path(self.folder) / f".claimed-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            (Path(self.folder) / "armed").rename(claimed)  # only one transfer claims it
        except FileNotFoundError:
            return None
        after = int(claimed.read_text())
        claimed.unlink()
        return after


class _PausingSink(GrpcRequestSink):
    def __init__(self, target, secret, timeout_s, channel, pause: KVPause, after_layers: int) -> None:
        super().__init__(target, secret, timeout_s, channel)
        self._pause, self._after_layers, self._layers = pause, after_layers, 0
        self._cancelled = threading.Event()

    def next_item(self):  # the sender thread
        item = super().next_item()
        if isinstance(item, LayerItem):
            self._layers += 1
            if self._layers == self._after_layers + 1:
                self._hold()
        return item

    def _hold(self) -> None:
        (Path(self._pause.folder) / "holding").touch()
        deadline = time.monotonic() + self._timeout_s
        release = Path(self._pause.folder) / "release"
        while time.monotonic() < deadline and not release.exists():
            if self._cancelled.wait(0.02):
                break

    def cancel(self) -> None:
        super().cancel()
        self._cancelled.set()
