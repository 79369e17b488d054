"""What the gateway holds: its configuration, the model's tokenizer and defaults, the worker
pool and dispatcher, admission (in-flight limit, draining) and metrics."""

from __future__ import annotations

import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.model_info import ModelInfo
from proto import worker_pb2 as pb
from router.dispatch import Dispatcher
from router.errors import APIError
from router.prefix_index import PrefixIndex
from router.workers import WorkerPool

T = TypeVar("T")


_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None  # --api-key: required on every route but health, ready, metrics
    max_queue: int = 256  # --max-queue: requests in flight before new ones get 429
    max_n: int = 16  # choices per request
    max_body_bytes: int = 16 << 20  # larger bodies get 413
    kv_transport: int = pb.KV_TRANSPORT_GRPC  # --kv-transport for disaggregated requests
    drain_timeout_s: float = 30.0  # --drain-timeout
    local_prefill_max_tokens: int = 0  # --local-prefill-max-tokens: shorter prompts skip the prefill worker

    def __post_init__(self) -> None:
        if self.max_queue < 1 or self.max_n < 1 or self.max_model_len < 2:
            raise ValueError("max_queue and max_n must be >= 1, max_model_len >= 2")


class RouterState:
    def __init__(self, config: RouterConfig, info: ModelInfo, pool: WorkerPool, index: PrefixIndex | None = None) -> None:
        self.config = config
        self.tokenizer = info.tokenizer
        self.generation = info.generation
        self.pool = pool
        self.index = index
        self.dispatcher = Dispatcher(pool, config.kv_transport, config.local_prefill_max_tokens, index,
                                     on_decision=self.record_decision)
        self.draining = False
        self.num_in_flight = 0
        self.started = time.time()
        self.registry = CollectorRegistry()
        self._metrics(self.registry)

    # -- admission ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_key(self, authorization: str | None) -> bool:
        if self.config.api_key is None:
            return True
        sent = (authorization or "").removeprefix("Bearer ").strip()
        return hmac.compare_digest(sent.encode(), self.config.api_key.encode())

    def admit(self, prepare: Callable[[], T]) -> T:
        """Start a generation request: refuse it (APIError) while draining, with no healthy
        worker or past --max-queue; else count it in flight and return ``prepare()``. A prepare
        that raises leaves nothing counted; a prepared request ends with ``finish_request``."""
        if self.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        if not self.pool.is_ready:
            raise APIError(503, "no healthy worker is available; try again shortly", headers={"Retry-After": "1"})
        if self.num_in_flight >= self.config.max_queue:
            raise APIError(429, f"too many requests in flight (--max-queue {self.config.max_queue}); retry later",
                           headers={"Retry-After": "1"})
        self._set_in_flight(self.num_in_flight + 1)
        try:
            return prepare()
        except BaseException:
            self._set_in_flight(self.num_in_flight - 1)
            raise

    def _set_in_flight(self, count: int) -> None:
        self.num_in_flight = count
        self._running.set(count)

    def finish_request(self, prepared, choices) -> None:
        self._set_in_flight(self.num_in_flight - 1)
        choices = list(choices)
        self._prompt_tokens.inc(sum(len(ids) for ids in prepared.prompt_ids))
        self._generation_tokens.inc(sum(len(c.token_ids) for c in choices))
        for choice in choices:
            self._finished.labels(choice.finish_reason or "error").inc()
        self._e2e.observe(time.perf_counter() - prepared.started)

    def record_chunk(self, prepared, choice, num_new_tokens: int) -> None:
        """A choice received ``num_new_tokens`` now: its first (time to first token, from
        admission) or the next (inter-token latency)."""
        if not num_new_tokens:
            return
        now = time.perf_counter()
        if choice.last_token_at is None:
            self._ttft.observe(now - prepared.started)
        else:
            self._itl.observe(now - choice.last_token_at)
        choice.last_token_at = now

    def record_decision(self, decision: str) -> None:
        self._decisions.labels(decision).inc()

    # -- metrics ------------------------------------------------------------------------------
    def _metrics(self, registry: CollectorRegistry) -> None:
        self._running = Gauge("tandem:num_requests_running", "Requests in flight at the router", registry=registry)
        self._prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self._generation_tokens = Counter("tandem:generation_tokens", "Tokens generated for finished requests",
                                          registry=registry)
        self._finished = Counter("tandem:request_success", "Finished sequences by finish reason", ["finished_reason"],
                                 registry=registry)
        # vLLM's buckets, so that dashboards built for it read these too
        self._e2e = Histogram("tandem:e2e_request_latency_seconds", "Admission to last token, per request",
                              buckets=_E2E_BUCKETS, registry=registry)
        self._ttft = Histogram("tandem:time_to_first_token_seconds", "Admission to each choice's first token",
                               buckets=_TTFT_BUCKETS, registry=registry)
        self._itl = Histogram("tandem:inter_token_latency_seconds", "Gap between a choice's consecutive tokens",
                              buckets=_ITL_BUCKETS, registry=registry)
        self._decisions = Counter("tandem:routing_decisions", "Dispatch decisions: remote or local prefill, "
                                  "retry on another pair, fallback to load routing", ["decision"], registry=registry)
        registry.register(_WorkerCollector(self.pool, self.config.served_model_name))


class _WorkerCollector:
    """Each worker's last Stats, as gauges labelled by role and address (read at scrape)."""

    _FIELDS = ("num_free_kv_blocks", "num_kv_blocks", "num_running", "num_waiting", "num_waiting_for_remote_kv",
               "num_prompt_tokens_computed", "num_generation_tokens", "kv_bytes_received", "kv_bytes_sent",
               "num_kv_recomputed", "num_kv_failed", "max_num_running")

    def __init__(self, pool: WorkerPool, model_name: str) -> None:
        self._pool = pool
        self._model_name = model_name

    def collect(self):
        yield from self._cluster_metrics()
        families = {name: GaugeMetricFamily(f"tandem:worker_{name}", f"worker Stats field {name}",
                                            labels=["role", "address"]) for name in self._FIELDS}
        healthy = GaugeMetricFamily("tandem:worker_healthy", "1 when the worker answered its last Stats",
                                    labels=["role", "address"])
        for worker in self._pool.decode + self._pool.prefill:
            healthy.add_metric([worker.role, worker.address], 1.0 if worker.healthy else 0.0)
            if worker.stats is not None:
                for name, family in families.items():
                    family.add_metric([worker.role, worker.address], float(getattr(worker.stats, name)))
        yield healthy
        yield from families.values()

    def _cluster_metrics(self):
        """DESIGN.md's per-worker names (labels model_name, worker, role) from the same Stats."""
        labels = ["model_name", "worker", "role"]
        usage = GaugeMetricFamily("tandem:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", labels=labels)
        waiting = GaugeMetricFamily("tandem:num_requests_waiting", "Requests queued on the worker (incl. waiting "
                                    "for remote KV)", labels=labels)
        counters = {
            "num_preemptions": CounterMetricFamily("tandem:num_preemptions", "Sequences preempted", labels=labels),
            "prefix_cache_queried_tokens": CounterMetricFamily("tandem:prefix_cache_queries", "Prompt tokens looked "
                                                               "up in the prefix cache", labels=labels),
            "prefix_cache_hit_tokens": CounterMetricFamily("tandem:prefix_cache_hits", "Prompt tokens whose KV was "
                                                           "reused", labels=labels),
        }
        transfer = CounterMetricFamily("tandem:kv_transfer_bytes", "KV bytes received (decode) or sent (prefill)",
                                       labels=labels)
        for worker in self._pool.decode + self._pool.prefill:
            stats = worker.stats
            if stats is None:
                continue
            values = [self._model_name, worker.address, worker.role]
            usage.add_metric(values, 1 - stats.num_free_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0)
            waiting.add_metric(values, stats.num_waiting + stats.num_waiting_for_remote_kv)
            for field, family in counters.items():
                family.add_metric(values, getattr(stats, field))
            transfer.add_metric(values, stats.kv_bytes_received if worker.role == "decode" else stats.kv_bytes_sent)
        yield usage
        yield waiting
        yield from counters.values()
        yield transfer
