"""What the gateway holds: its configuration, the model's tokenizer and defaults, the worker
pool and dispatcher, admission (router/admission.py: places, the queue by traffic class,
shedding; draining) and metrics."""

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
from proto.rpc import Role
from router.admission import Admission, Ticket
from router.dispatch import Dispatcher
from router.errors import APIError
from router.limits import RequestLimits
from router.policy import RouteRequest
from router.protocol import RequestKind
from router.request_trace import RequestTrace
from router.traffic import ClassChoice, TrafficClasses
from router.ttft import TTFTPredictor
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
    traffic: TrafficClasses = TrafficClasses()  # --traffic-classes under --scheduling-policy (router/traffic.py)

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
        self.started = time.time()
        self.tracing = tracing  # None: tracing off
        self.registry = CollectorRegistry()
        self.metrics = RouterMetrics(self.registry)
        self.registry.register(ClusterCollector(pool, config.served_model_name))
        self.admission = Admission(config.max_queue, config.traffic.policy, self._dispatch_limit, self._count_shed)
        counts = self.admission.counts  # the gauges read it at scrape time
        self.metrics.running.set_function(lambda: counts.held)
        for name in config.traffic.names:
            self.metrics.queued.labels(name).set_function(lambda name=name: self.admission.queued(name))
            self.metrics.declare_class(name)  # every class's series exist from the start, at 0
        self.ttft = TTFTPredictor(pool)

    # -- admission ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_key(self, authorization: str | None) -> bool:
        if self.config.api_key is None:
            return True
        sent = (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(sent.encode(), self.config.api_key.encode())

    @property
    def num_in_flight(self) -> int:
        """Sequences admission holds (queued here or on the workers; tokenize calls count one)."""
        return self.admission.counts.held

    def resolve_class(self, traffic_class: str | None, priority: int | None) -> ClassChoice:
        """A request's traffic class and priority (400 for an unknown class, or a priority the
        scheduling policy does not allow)."""
        return self.config.traffic.resolve(traffic_class, priority)

    async def admit(self, prepare: Callable[[], T], request_id: str, num_sequences: int,
                    choice: ClassChoice | None = None) -> T:
        """Start a generation request of ``num_sequences`` sequences (prompts x n) of traffic
        class ``choice``: refuse it (APIError) while draining, with no healthy worker, or when
        admission has no place (router/admission.py); else hold its places, run ``prepare()``
        in the tokenizer pool (its tokenizing and validation are the request's ``tokenize``
        stage), shed it if its class is sheddable and its predicted time to first token
        misses the class's target, and return once it may be dispatched. A prepare that
        raises, a shed or a timeout leaves nothing held; a returned request ends with
        ``finish_request``."""
        choice = choice or self.resolve_class(None, None)
        self._check_serving()
        ticket = self.admission.hold(num_sequences, choice)  # held until finish_request
        try:
            trace = RequestTrace(request_id, self.tracing, traffic_class=choice.traffic_class.name,
                                 priority=choice.priority)
            prepared = await self.run_frontend(prepare)
            assert len(prepared.sequences) == num_sequences, "admission counted other sequences than were made"
            prepared.ticket = ticket
            routed = await self._shed_if_late(prepared, ticket) if choice.traffic_class.sheddable else {}
            waited = time.monotonic()
            deadline = trace.started + self.config.request_timeout_s  # admission to last token, queue included
            await self.admission.wait_turn(ticket, max(0.0, deadline - waited))
            trace.queued_s = time.monotonic() - waited
        except BaseException:
            self.admission.release(ticket)
            raise
        operation = "chat" if prepared.kind is RequestKind.CHAT else "text_completion"
        trace.begin(operation, self.config.served_model_name, prepared.sequences[0].request.params,
                    len(prepared.sequences))
        prepared.trace, prepared.started = trace, trace.started
        if ticket.turn is not None:
            routed = {}  # it waited in the queue: the index's answer may be stale, dispatch asks again
        prepared.sequences = [dataclasses.replace(s, trace=t, deadline=deadline, route=routed.get(s.index))
                              for s, t in zip(prepared.sequences, trace.sequences)]
        return prepared

    async def _shed_if_late(self, prepared, ticket: Ticket) -> dict[int, RouteRequest]:
        """SLO-aware admission: raise a 429 when the request's predicted time to first token
        (router/ttft.py; its longest prompt, its cache hits as the prefix index knows them)
        exceeds its class's target. Returns the route it looked up, by sequence index, for
        dispatch to reuse."""
        sequence = max(prepared.sequences, key=lambda s: len(s.request.prompt_token_ids))
        request = sequence.request
        route = await self.dispatcher.route(request)
        cached = max(route.hits.values(), default=0) if route.hits else 0
        ahead = self.admission.queued_ahead(ticket.choice) + ticket.num_sequences
        predicted = self.ttft.predict(len(request.prompt_token_ids), cached, ahead, self.admission.room())
        if predicted * 1000 > ticket.choice.traffic_class.ttft_ms:
            raise self.admission.shed(ticket, predicted)
        return {sequence.index: route}

    @contextlib.asynccontextmanager
    async def admitted(self, num_sequences: int = 1):
        """Hold ``num_sequences`` admission places for the block (tokenize endpoints hold one)."""
        self._check_serving()
        self.admission.hold_plain(num_sequences)
        try:
            yield
        finally:
            self.admission.release_plain(num_sequences)

    def _check_serving(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if not self.pool.is_ready:
            raise APIError(503, "no healthy worker is available; try again shortly", headers={"Retry-After": "1"})

    def _dispatch_limit(self) -> int:
        """Sequences the healthy decode workers run at once (their max_num_seqs), which the
        priority policy dispatches at most; until their Stats say, --max-queue."""
        workers = [w for w in self.pool.routable(Role.DECODE) if w.healthy and w.stats is not None]
        limits = [w.stats.max_num_seqs for w in workers if w.stats.max_num_seqs]
        return sum(limits) if limits else self.config.max_queue

    def _count_shed(self, choice: ClassChoice, reason: str) -> None:
        self.metrics.shed.labels(choice.traffic_class.name, reason).inc()

    async def run_frontend(self, work: Callable[[], T]) -> T:
        """``work()`` in the tokenizer pool (tokenizing, chat templates, detokenizing)."""
        return await asyncio.get_running_loop().run_in_executor(self.frontend, work)

    def finish_request(self, prepared, choices) -> None:
        self.admission.release(prepared.ticket)
        choices = sorted(choices, key=lambda c: c.index)
        metrics, label = self.metrics, prepared.trace.traffic_class
        now = time.monotonic()
        num_prompt = sum(len(ids) for ids in prepared.prompt_ids)
        num_generated = sum(len(c.token_ids) for c in choices)
        metrics.prompt_tokens.inc(num_prompt)
        metrics.generation_tokens.inc(num_generated)
        metrics.prompt_length.labels(label).observe(num_prompt)
        metrics.generation_length.labels(label).observe(num_generated)
        for choice in choices:
            metrics.finished.labels(choice.finish_reason or FinishReason.ERROR).inc()
            if choice.num_preemptions:
                metrics.preempted.labels(label).inc(choice.num_preemptions)
            if choice.first_token_at is not None and len(choice.token_ids) > 1:
                metrics.tpot.labels(label).observe((choice.last_token_at - choice.first_token_at)
                                                   / (len(choice.token_ids) - 1))
            self.ttft.sequence_finished(now)
        for sequence in prepared.trace.sequences:
            if sequence.stages is not None and sequence.stages.remote_prefill:
                self.ttft.transfer_observed(sequence.stages.kv_transfer)
        metrics.e2e.labels(label).observe(now - prepared.started)
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
        label = prepared.trace.traffic_class
        if choice.last_token_at is None:
            self.metrics.ttft.labels(label).observe(now - prepared.started)
            choice.first_token_at = now
        else:
            self.metrics.itl.labels(label).observe(now - choice.last_token_at)
        choice.last_token_at = now

    def record_decision(self, decision: str) -> None:
        self.metrics.decisions.labels(decision).inc()
