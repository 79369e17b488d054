"""The in-process transport: the twin that unit tests use in place of a network.

It does what a wire does, minus the wire: every tensor is copied (the receiver never shares
memory with the sender), bytes are counted, and the first token completes the transfer."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from engine.engine_core import EngineCore, EngineCoreOutput, KVLanding
from engine.outputs import FinishReason
from engine.remote_kv import KVSink, PrefillTiming
from engine.scheduler_types import SampledToken


@dataclass
class InProcessKVSink(KVSink):
    receiver: EngineCore
    bytes_sent: int = 0
    first_outputs: list[EngineCoreOutput] = field(default_factory=list)  # receiver's first-token outputs
    closed: dict[str, FinishReason] = field(default_factory=dict)  # request id -> why it ended on the sender
    errors: dict[str, str] = field(default_factory=dict)  # request id -> what the receiver refused

    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        self.bytes_sent += kv.numel() * kv.element_size()
        try:
            self.receiver.write_remote_kv(request_id, layer, start_pos, kv.clone())
        except (KeyError, ValueError) as exc:
            self.errors[request_id] = str(exc)

    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        try:
            landing = KVLanding(time.monotonic(), None, timing)
            self.first_outputs.append(self.receiver.finish_remote_kv(request_id, token, num_cached_tokens, landing))
        except (KeyError, ValueError) as exc:
            self.errors[request_id] = str(exc)

    def close(self, request_id: str, finish_reason: FinishReason) -> None:
        self.closed[request_id] = finish_reason
