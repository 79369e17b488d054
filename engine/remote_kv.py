"""The engine's side of disaggregation: exporting a prompt's KV as it is computed (prefill
role) and importing it into reserved blocks (decode role). Transports (kv_transfer/) plug in
through ``KVSink``; the engine never knows how bytes travel."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import FinishReason
from engine.scheduler_types import SampledToken


class KVFailurePolicy(enum.Enum):
    """What a decode engine does when a request's remote KV fails (corrupt, refused, sender
    gone) or does not arrive before its deadline."""

    RECOMPUTE = "recompute"  # discard what arrived and prefill the prompt here
    FAIL = "fail"  # the request ends with an error the client sees


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """What the prefill side measured for one request (sent along with its first token)."""

    queue_s: float = 0.0  # the request arrived until its prefill began
    prefill_s: float = 0.0  # its prefill began until the first token was sampled


class KVSink(ABC):
    """Where a prefill engine sends one request's KV.

    Contract: the engine calls ``send_layer`` on its own thread right after a layer of a step
    has written the request's new KV (so early layers leave while later layers compute), with
    a tensor it will not touch again; the sink may queue it and return at once. After the last
    layer of the step that completes the prompt, the engine calls ``send_first_token`` once.
    ``close`` is called exactly once when the request ends, whatever the reason (idempotent
    for the sink). A sink never blocks the engine for long and never raises into it: errors
    are reported on its own channel.
    """

    @abstractmethod
    def send_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        """kv: [num_tokens, 2 * kv_heads, head_dim] for positions start_pos ... (keys then values)."""

    @abstractmethod
    def send_first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                         timing: PrefillTiming = PrefillTiming()) -> None:
        """The prompt is complete on the sender; ``token`` was sampled from its last position.
        ``num_cached_tokens``: leading prompt positions the sender reused from its own cache;
        ``timing``: how long it queued and prefilled there."""

    @abstractmethod
    def close(self, request_id: str, finish_reason: FinishReason) -> None:
        """The request is gone from the prefill engine, for ``finish_reason``."""


@dataclass(frozen=True, slots=True)
class KVExport:
    """Export a request's KV for positions [from_pos, prompt_len) to ``sink``."""

    sink: KVSink
    from_pos: int  # the receiver already holds positions before this (its prefix-cache hit)


class RemoteKVState:
    """What a decode engine has received for one request: per layer, which positions in
    [from_pos, prompt_len) have landed. The request may run only when all have."""

    def __init__(self, num_layers: int, from_pos: int, prompt_len: int, policy: KVFailurePolicy) -> None:
        self.policy = policy
        self.from_pos = from_pos
        self.prompt_len = prompt_len
        self.received = np.zeros((num_layers, prompt_len - from_pos), dtype=bool)
        self.num_bytes = 0

    def record(self, layer: int, start_pos: int, num_tokens: int, num_bytes: int) -> None:
        if not 0 <= layer < self.received.shape[0]:
            raise ValueError(f"layer {layer} out of range [0, {self.received.shape[0]})")
        if start_pos < self.from_pos or start_pos + num_tokens > self.prompt_len or num_tokens < 1:
            raise ValueError(
                f"positions [{start_pos}, {start_pos + num_tokens}) outside the expected "
                f"[{self.from_pos}, {self.prompt_len})"
            )
        window = self.received[layer, start_pos - self.from_pos : start_pos - self.from_pos + num_tokens]
        if window.any():
            raise ValueError(f"layer {layer} positions from {start_pos} were already received")
        window[:] = True
        self.num_bytes += num_bytes

    @property
    def is_complete(self) -> bool:
        return bool(self.received.all())

    def missing(self) -> str:
        layers = np.flatnonzero(~self.received.all(axis=1))
        return f"{len(layers)} of {self.received.shape[0]} layers incomplete (first: {layers[:5].tolist()})"


class KVImporter:
    """Decode role: receives KV for requests parked in WAITING_FOR_REMOTE_KV and writes it
    into their reserved blocks. Nothing is written before it is checked; a request may run
    only once every expected (layer, position) has landed exactly once."""

    def __init__(self, kv_cache, kv_manager, num_layers: int) -> None:
        self._kv_cache = kv_cache
        self._kv_manager = kv_manager
        self._num_layers = num_layers
        self._states: dict[str, RemoteKVState] = {}
        self.num_bytes_received = 0

    def expect(self, request_id: str, from_pos: int, prompt_len: int, policy: KVFailurePolicy) -> None:
        self._states[request_id] = RemoteKVState(self._num_layers, from_pos, prompt_len, policy)

    def write(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        state = self._states.get(request_id)
        if state is None:
            raise KeyError(f"request '{request_id}' is not waiting for KV (unknown, finished or expired)")
        cache = self._kv_cache.layers[0]
        expected = (kv.shape[0], *cache.shape[2:])
        if kv.dim() != 3 or tuple(kv.shape) != expected or kv.dtype != cache.dtype:
            raise ValueError(f"KV {tuple(kv.shape)} {kv.dtype} does not match {expected} {cache.dtype}")
        num_bytes = kv.numel() * kv.element_size()
        state.record(layer, start_pos, kv.shape[0], num_bytes)
        slots = self._kv_cache.slots_for(self._kv_manager.block_table(request_id), start_pos, start_pos + kv.shape[0])
        self._kv_cache.write_slots(layer, slots, kv)
        self.num_bytes_received += num_bytes

    def take_complete(self, request_id: str) -> RemoteKVState:
        """The finished state (removed); raises ValueError if anything is missing."""
        state = self._states.get(request_id)
        if state is None:
            raise KeyError(f"request '{request_id}' is not waiting for KV")
        if not state.is_complete:
            raise ValueError(f"request '{request_id}': KV incomplete, {state.missing()}; it will not run")
        return self._states.pop(request_id)

    def drop(self, request_id: str) -> RemoteKVState | None:
        return self._states.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states


class KVExporter:
    """Prefill role: routes each exporting request's KV and first token to its sink."""

    def __init__(self) -> None:
        self._sinks: dict[str, KVSink] = {}

    def register(self, request_id: str, sink: KVSink) -> None:
        self._sinks[request_id] = sink

    def on_layer(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.send_layer(request_id, layer, start_pos, kv)

    def first_token(self, request_id: str, token: SampledToken, num_cached_tokens: int,
                    timing: PrefillTiming) -> None:
        sink = self._sinks.get(request_id)
        if sink is not None:
            sink.send_first_token(request_id, token, num_cached_tokens, timing)

    def close(self, request_id: str, finish_reason: FinishReason) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.close(request_id, finish_reason)


def prefill_side_params(params, seed: int):
    """The sampling parameters a prefill engine uses for a request whose decode happens
    elsewhere: one token, sampled exactly as the decode engine would sample it (same seed,
    same EOS / stop-token blocking for min_tokens). Stop strings and later positions are the
    decode engine's business."""
    return params.with_overrides(
        n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1), seed=seed, stop=(), prompt_logprobs=None
    )
