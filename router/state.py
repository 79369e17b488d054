"""What the gateway holds: its configuration, the model's tokenizer and defaults, the worker
pool and dispatcher, admission (in-flight limit, draining) and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry

from engine.model_info import ModelInfo
from engine.outputs import FinishReason
from prefix_index.reader import PrefixIndex
from proto import worker_pb2 as pb
from router.dispatch import Dispatcher
from router.errors import APIError
from router.limits import RequestLimits
from router.protocol import RequestKind
from router.request_trace import RequestTrace
from router.workers import WorkerPool
from telemetry.metrics import ClusterCollector, RouterMetrics
from telemetry.tracing import Tracing

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None  # --api-key: required on every route but health, ready, metrics
    max_queue: int = 256  # --max-queue: sequences (prompts x n) in flight before new requests get 429
    limits: RequestLimits = RequestLimits()  # what one request may ask for (each over-limit field: 400)
    max_body_bytes: int = 16 << 20  # larger bodies get 413
    tokenizer_threads: int = 2  # --tokenizer-threads: the pool that tokenizes and renders chat templates
    kv_transport: int = pb.KV_TRANSPORT_GRPC  # --kv-transport for disaggregated requests
    drain_timeout_s: float = 30.0  # --drain-timeout
    local_prefill_max_tokens: int = 0  # --local-prefill-max-tokens: shorter prompts skip the prefill worker
    request_timeout_s: float = 600.0  # --request-timeout: admission to last token, or 504
    migration_limit: int = 3  # --migration-limit: moves to another decode worker after the first token

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.tokenizer_threads < 1 or self.max_model_len < 2:
            raise ValueError("max_queue and tokenizer_threads must be >= 1, max_model_len >= 2")
        if self.migration_limit < 0:
            raise ValueError(f"migration_limit must be >= 0, got {self.migration_limit}")
        if not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")


class RouterState:
    def __init__(self, config: RouterConfig, info: ModelInfo, pool: WorkerPool, index: PrefixIndex | None = None,
                 tracing: Tracing | None = None) -> None:
        self.config = config
        self.tokenizer = info.tokenizer
        self.vocab_size = info.arch.vocab_size  # token ids a request may name: [0, vocab_size)
        # tokenizing and chat templates run here, off the event loop, so that a long prompt
        # cannot hold up other requests' streams; admission bounds what waits for it
        self.frontend = ThreadPoolExecutor(config.tokenizer_threads, thread_name_prefix="tokenize")
        self.generation = info.generation
        self.pool = pool
        self.index = index
        self.dispatcher = Dispatcher(pool, config.kv_transport, config.local_prefill_max_tokens, index,
                                     on_decision=self.record_decision, request_timeout_s=config.request_timeout_s,
                                     migration_limit=config.migration_limit)
        self.draining = False
        self.num_in_flight = 0
        self.started = time.time()
        self.tracing = tracing  # None: tracing off
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.registry.register(ClusterCollector(pool, config.served_model_name))

    # -- admission ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_key(self, authorization: str | None) -> bool:
        if self.config.api_key is None:
            return True
        sent = (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(sent.encode(), self.config.api_key.encode())

    async def admit(self, prepare: Callable[[], T], request_id: str, num_sequences: int) -> T:
        """Start a generation request of ``num_sequences`` sequences (prompts x n): refuse it
        (APIError) while draining, with no healthy worker or past --max-queue sequences in
        flight; else count them in flight and return ``prepare()``, run in the tokenizer pool
        (its tokenizing and validation are the request's ``tokenize`` stage). A prepare that
        raises leaves nothing counted; a prepared request ends with ``finish_request``."""
        self._reserve(num_sequences)  # held until finish_request
        try:
            trace = RequestTrace(request_id, self.tracing)
            prepared = await self.run_frontend(prepare)
            assert len(prepared.sequences) == num_sequences, "admission counted other sequences than were made"
        except BaseException:
            self._set_in_flight(self.num_in_flight - num_sequences)
            raise
        operation = "chat" if prepared.kind is RequestKind.CHAT else "text_completion"
        trace.begin(operation, self.config.served_model_name, prepared.sequences[0].request.params,
                    len(prepared.sequences))
        prepared.trace, prepared.started = trace, trace.started
        prepared.sequences = [dataclasses.replace(s, trace=t) for s, t in zip(prepared.sequences, trace.sequences)]
        return prepared

    @contextlib.asynccontextmanager
    async def admitted(self, num_sequences: int = 1):
        """Hold ``num_sequences`` admission slots for the block (tokenize endpoints hold one)."""
        self._reserve(num_sequences)
        try:
            yield
        finally:
            self._set_in_flight(self.num_in_flight - num_sequences)

    def _reserve(self, num_sequences: int) -> None:
        """Count ``num_sequences`` in flight, or refuse (APIError) while draining, with no
        healthy worker or past --max-queue."""
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if not self.pool.is_ready:
            raise APIError(503, "no healthy worker is available; try again shortly", headers={"Retry-After": "1"})
        if self.num_in_flight + num_sequences > self.config.max_queue:
            raise APIError(429, f"too many sequences in flight (--max-queue {self.config.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        self._set_in_flight(self.num_in_flight + num_sequences)

    async def run_frontend(self, work: Callable[[], T]) -> T:
        """``work()`` in the tokenizer pool (tokenizing, chat templates, detokenizing)."""
        return await asyncio.get_running_loop().run_in_executor(self.frontend, work)

    def _set_in_flight(self, count: int) -> None:
        self.num_in_flight = count
        self.metrics.running.set(count)

    def finish_request(self, prepared, choices) -> None:
        self._set_in_flight(self.num_in_flight - len(prepared.sequences))
        choices = sorted(choices, key=lambda c: c.index)
        metrics = self.metrics
        metrics.prompt_tokens.inc(sum(len(ids) for ids in prepared.prompt_ids))
        metrics.generation_tokens.inc(sum(len(c.token_ids) for c in choices))
        for choice in choices:
            metrics.finished.labels(choice.finish_reason or FinishReason.ERROR).inc()
        metrics.e2e.observe(time.monotonic() - prepared.started)
        unfinished = [c.index for c in choices if c.finish_reason in (None, FinishReason.ERROR)]
        prepared.trace.finish(metrics, choices, prepared.prompt_ids, prepared.prompt_texts,
                              f"choices {unfinished} did not finish" if unfinished else None)

    def record_chunk(self, prepared, choice, chunk: pb.GenerateChunk) -> None:
        """A choice received ``chunk`` now: its first token (time to first token, from
        admission), the next ones (inter-token latency), and on its last chunk the workers'
        stage times."""
        now = time.monotonic()
        sequence = prepared.trace.sequences[choice.index]
        sequence.last_chunk_at = now
        if chunk.HasField("stages"):
            sequence.stages = chunk.stages
        if not chunk.token_ids:
            return
        if choice.last_token_at is None:
            self.metrics.ttft.observe(now - prepared.started)
            choice.first_token_at = now
        else:
            self.metrics.itl.observe(now - choice.last_token_at)
        choice.last_token_at = now

    def record_decision(self, decision: str) -> None:
        self.metrics.decisions.labels(decision).inc()
