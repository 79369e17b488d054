"""Hands KV that arrived on a network thread to the engine thread.

The decode engine is single-threaded: transports never touch it directly. They put
arrivals here; the worker's engine loop calls ``drain_into`` between steps, which applies
them in order and turns anything the engine refuses into a failed transfer (its partial KV is
never used; the request's failure policy decides between prefilling it locally and failing it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.engine_core import EngineCore, EngineCoreOutput, KVLanding
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
    sender_cached_tokens: int  # prompt positions the sender reused from its own cache
    landing: KVLanding | None = None  # when it (and the first chunk) arrived, what the sender measured


@dataclass(frozen=True, slots=True)
class TransferFailed:
    request_id: str
    reason: str


Arrival = KVArrival | FirstTokenArrival | TransferFailed


@dataclass(slots=True)
class DrainResult:
    outputs: list[EngineCoreOutput] = field(default_factory=list)  # first tokens, and failures under `fail`
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its transfer failed


class EngineInbox:
    """``on_put`` (optional) is called after every put, on the putting thread: the engine
    loop uses it to wake up."""

    def __init__(self, on_put: Callable[[], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._items: list[Arrival] = []
        self.on_put = on_put

    def put(self, item: Arrival) -> None:
        with self._lock:
            self._items.append(item)
        if self.on_put is not None:
            self.on_put()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)

    def drain_into(self, engine: EngineCore) -> DrainResult:
        with self._lock:
            items, self._items = self._items, []
        result = DrainResult()
        for item in items:
            if item.request_id in result.failed:
                continue  # already given up on: later pieces are dropped
            try:
                if isinstance(item, KVArrival):
                    engine.write_remote_kv(item.request_id, item.layer, item.start_pos, item.kv)
                elif isinstance(item, FirstTokenArrival):
                    result.outputs.append(
                        engine.finish_remote_kv(item.request_id, item.token, item.sender_cached_tokens,
                                                item.landing))
                else:
                    self._fail(engine, item.request_id, item.reason, result)
            except (KeyError, ValueError) as exc:
                self._fail(engine, item.request_id, str(exc), result)
        return result

    @staticmethod
    def _fail(engine: EngineCore, request_id: str, reason: str, result: DrainResult) -> None:
        if request_id not in engine.kv_importer:
            return  # not waiting for KV (finished, aborted, already failed): nothing to undo
        result.failed[request_id] = reason
        output = engine.remote_kv_failed(request_id, reason)
        if output is not None:
            result.outputs.append(output)
