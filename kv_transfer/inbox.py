"""Hands KV that arrived on a network thread to the engine thread.

The decode engine is single-threaded: transports never touch it directly. They put
arrivals here; the worker's engine loop calls ``drain_into`` between steps, which applies
them in order and turns anything the engine refuses into a fallback (the request is
prefilled locally; its partial KV is never used)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.engine_core import EngineCore, EngineCoreOutput
from engine.scheduler_types import SampledToken


@dataclass(frozen=True, slots=True)
class KVArrival:
    request_id: str
    layer: int
    start_pos: int
    kv: torch.Tensor  # [num_tokens, 2 * kv_heads, head_dim]


@dataclass(frozen=True, slots=True)
class FirstTokenArrival:
    request_id: str
    token: SampledToken


@dataclass(frozen=True, slots=True)
class TransferFailed:
    request_id: str
    reason: str


Arrival = KVArrival | FirstTokenArrival | TransferFailed


@dataclass(slots=True)
class DrainResult:
    outputs: list[EngineCoreOutput] = field(default_factory=list)  # first tokens of requests now running
    fallbacks: dict[str, str] = field(default_factory=dict)  # request id -> why it is prefilled locally


class EngineInbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: list[Arrival] = []

    def put(self, item: Arrival) -> None:
        with self._lock:
            self._items.append(item)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def drain_into(self, engine: EngineCore) -> DrainResult:
        with self._lock:
            items, self._items = self._items, []
        result = DrainResult()
        for item in items:
            if item.request_id in result.fallbacks:
                continue  # already given up on: later pieces are dropped
            try:
                if isinstance(item, KVArrival):
                    engine.write_remote_kv(item.request_id, item.layer, item.start_pos, item.kv)
                elif isinstance(item, FirstTokenArrival):
                    result.outputs.append(engine.finish_remote_kv(item.request_id, item.token))
                else:
                    self._fall_back(engine, item.request_id, item.reason, result)
            except (KeyError, ValueError) as exc:
                self._fall_back(engine, item.request_id, str(exc), result)
        return result

    @staticmethod
    def _fall_back(engine: EngineCore, request_id: str, reason: str, result: DrainResult) -> None:
        if engine.fallback_remote_kv(request_id):
            result.fallbacks[request_id] = reason
