"""Prometheus metrics: the router's own (per request, per token, per stage) and the cluster's
(every worker's last Stats, read at scrape time). Names as in DESIGN.md, histogram buckets
as vLLM's, so that dashboards built for vLLM read these too. docs/observability.md explains
each one."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from proto.rpc import Role

# DESIGN.md's stages, in the order a request meets them
STAGES = ("tokenize", "route", "prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode", "stream")
WORKER_STAGES = ("prefill_queue", "prefill", "kv_transfer", "decode_queue", "decode")  # fields of StageTimes

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


TOKEN_COUNT_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
CLASS = ["traffic_class"]  # router/traffic.py: every per-request histogram is labelled by class
SHED_REASONS = ("predicted_ttft", "displaced")  # router/admission.py


class RouterMetrics:
    """The router's metrics in one registry (``/metrics`` serves it)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.running = Gauge("tandem:num_requests_running", "Sequences held by the router's admission (queued there "
                             "or on the workers)", registry=registry)
        self.queued = Gauge("tandem:num_requests_queued", "Sequences waiting in the router's admission queue for "
                            "room on the workers (--scheduling-policy priority)", CLASS, registry=registry)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated for finished requests",
                                         registry=registry)
        self.finished = Counter("tandem:request_success", "Finished sequences by finish reason", ["finished_reason"],
                                registry=registry)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "Arrival to the response's end, per request",
                             CLASS, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Arrival to each choice's first token",
                              CLASS, buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Gap between a choice's consecutive tokens",
                             CLASS, buckets=ITL_BUCKETS, registry=registry)
        self.tpot = Histogram("tandem:request_time_per_output_token_seconds", "Per choice: its first token to its "
                              "last, divided by the tokens after the first", CLASS, buckets=ITL_BUCKETS,
                              registry=registry)
        self.queue_time = Histogram("tandem:request_queue_time_seconds", "Time a sequence waited in queues (the "
                                    "router's admission queue, then the prefill_queue and decode_queue stages)",
                                    CLASS, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self.prompt_length = Histogram("tandem:request_prompt_tokens", "Prompt tokens per finished request", CLASS,
                                       buckets=TOKEN_COUNT_BUCKETS, registry=registry)
        self.generation_length = Histogram("tandem:request_generation_tokens", "Generated tokens per finished "
                                           "request (all its choices)", CLASS, buckets=TOKEN_COUNT_BUCKETS,
                                           registry=registry)
        self.preempted = Counter("tandem:request_preemptions", "Times the decode workers preempted a finished "
                                 "sequence (its KV freed, its tokens recomputed later)", CLASS, registry=registry)
        self.shed = Counter("tandem:requests_shed", "Requests refused with 429 by SLO-aware admission: "
                            "predicted_ttft (its class's ttft_ms would be missed) or displaced (queued, it made "
                            "room for a higher class)", CLASS + ["reason"], registry=registry)
        self.stage = Histogram("tandem:stage_latency_seconds", "Time on the critical path per stage", ["stage"],
                               buckets=TTFT_BUCKETS, registry=registry)
        self.kv_transfer = Histogram("tandem:kv_transfer_seconds", "A remote prefill's KV transfer, first chunk "
                                     "to last message landing on the decode worker (overlaps the prefill)",
                                     buckets=TTFT_BUCKETS, registry=registry)
        self.decisions = Counter("tandem:routing_decisions", "Dispatch decisions: remote or local prefill, "
                                 "local_fallback (no prefill worker serves: the decode worker prefills), retry "
                                 "on another worker, migrate (a stream moved after its decode worker was lost), "
                                 "fallback to load routing", ["decision"], registry=registry)


    def declare_class(self, traffic_class: str) -> None:
        """Create a traffic class's series (Prometheus shows a labelled series only once it exists)."""
        for metric in (self.e2e, self.ttft, self.itl, self.tpot, self.queue_time, self.prompt_length,
                       self.generation_length, self.preempted):
            metric.labels(traffic_class)
        for reason in SHED_REASONS:
            self.shed.labels(traffic_class, reason)


class ClusterCollector:
    """Each worker's last Stats: DESIGN.md's per-worker names (labels model_name, worker, role)
    and every Stats field as ``tandem:worker_<field>{role,address}``. ``pool`` is the router's
    WorkerPool (its ``decode`` and ``prefill`` lists of workers with ``stats``)."""

    _FIELDS = ("num_free_kv_blocks", "num_kv_blocks", "num_running", "num_waiting", "num_waiting_for_remote_kv",
               "num_prompt_tokens_computed", "num_generation_tokens", "kv_bytes_received", "kv_bytes_sent",
               "num_kv_recomputed", "num_kv_failed", "num_held_transfers", "max_num_running", "max_num_seqs",
               "num_lane_prompts", "num_lane_prompt_tokens", "lane_busy_ms", "num_in_lane",
               "stream_pace_ms", "num_decode_steps", "decode_steps_ms", "decode_steps_seqs", "num_prompt_steps",
               "prompt_steps_ms", "lane_ms_per_token", "lane_slowdown", "step_ms_per_prompt_token",
               "step_ms_per_prompt_token_beside", "num_lane_layers_helped")

    def __init__(self, pool, model_name: str) -> None:
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
        failures = CounterMetricFamily("tandem:kv_transfer_failures", "Remote prefills whose KV failed or came late "
                                       "(then recomputed or failed by policy), per decode worker", labels=labels)
        for worker in self._pool.decode + self._pool.prefill:
            stats = worker.stats
            if stats is None:
                continue
            values = [self._model_name, worker.address, worker.role]
            usage.add_metric(values, 1 - stats.num_free_kv_blocks / stats.num_kv_blocks if stats.num_kv_blocks else 0)
            waiting.add_metric(values, stats.num_waiting + stats.num_waiting_for_remote_kv)
            for field, family in counters.items():
                family.add_metric(values, getattr(stats, field))
            transfer.add_metric(values, stats.kv_bytes_received if worker.role == Role.DECODE else stats.kv_bytes_sent)
            if worker.role == Role.DECODE:
                failures.add_metric(values, stats.num_kv_recomputed + stats.num_kv_failed)
        yield usage
        yield waiting
        yield from counters.values()
        yield transfer
        yield failures
        yield self._chunk_histogram(labels)

    def _chunk_histogram(self, labels: list[str]) -> HistogramMetricFamily:
        """``tandem:prefill_chunk_tokens``: prompt tokens per step that computed some, per
        worker (the chunk sizes its step budget chose, with the bucket bounds the worker sends)."""
        family = HistogramMetricFamily("tandem:prefill_chunk_tokens", "Prompt tokens computed per engine step "
                                       "(chunked prefill sizes, bounded by --max-step-ms)", labels=labels)
        for worker in self._pool.decode + self._pool.prefill:
            stats = worker.stats
            if stats is None or len(stats.prefill_chunk_counts) != len(stats.prefill_chunk_bounds) + 1:
                continue
            bounds = [str(float(b)) for b in stats.prefill_chunk_bounds] + ["+Inf"]
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, stats.prefill_chunk_counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([self._model_name, worker.address, worker.role], buckets,
                              stats.prefill_chunk_tokens_sum)
        return family
