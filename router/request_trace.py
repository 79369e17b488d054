"""Where one request's time went, seen from the router: its stages (tokenize, route, stream
here; the workers' stages from the last chunk of each sequence) as Prometheus histograms, and,
with tracing on, its SERVER span with the router's stage spans under it. The workers make
their own spans under the same parent (its W3C context travels in each Generate call)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.outputs import FinishReason
from proto import worker_pb2 as pb
from telemetry.metrics import WORKER_STAGES, RouterMetrics
from telemetry.tracing import Tracing, inject, unix_ns


@dataclass(slots=True)
class SequenceTrace:
    """One sequence (choice) of the request, on the router's monotonic clock."""

    route_started: float | None = None
    route_ended: float | None = None
    decode: str | None = None  # the workers chosen (the last attempt's)
    prefill: str | None = None  # None: prefilled on the decode worker
    attempts: int = 0
    last_chunk_at: float | None = None
    stages: pb.StageTimes | None = None  # from its last chunk
    metadata: tuple[tuple[str, str], ...] = ()  # the trace context for its Generate call


@dataclass(slots=True)
class RequestTrace:
    request_id: str
    tracing: Tracing | None
    started: float = field(default_factory=time.monotonic)  # admission began (before tokenizing)
    tokenized: float | None = None
    root: object | None = None  # the SERVER span, with tracing on
    sequences: list[SequenceTrace] = field(default_factory=list)
    traffic_class: str = "default"  # router/traffic.py: the label of its per-class metrics
    priority: int = 0
    queued_s: float = 0.0  # waited in the router's admission queue for room on the workers

    def begin(self, operation: str, model: str, params: pb.SamplingParams, num_sequences: int) -> None:
        """Tokenized and validated: open the request span (tracing on) and one trace per sequence."""
        self.tokenized = time.monotonic()
        metadata: tuple[tuple[str, str], ...] = ()
        if self.tracing is not None:
            attributes = {
                "gen_ai.operation.name": operation, "gen_ai.request.model": model,
                "gen_ai.provider.name": "tandem", "tandem.request_id": self.request_id,
                "gen_ai.request.max_tokens": params.max_tokens if params.HasField("max_tokens") else None,
                "gen_ai.request.temperature": params.temperature if params.HasField("temperature") else None,
                "gen_ai.request.top_p": params.top_p if params.HasField("top_p") else None,
                "gen_ai.request.seed": params.seed if params.HasField("seed") else None,
                "gen_ai.request.choice.count": num_sequences,
                "tandem.traffic_class": self.traffic_class, "tandem.priority": self.priority,
            }
            self.root = self.tracing.start(f"{operation} {model}", None, unix_ns(self.started), SpanKind.SERVER,
                                           attributes)
            metadata = inject(self.root)
        self.sequences = [SequenceTrace(metadata=metadata) for _ in range(num_sequences)]

    def finish(self, metrics: RouterMetrics, choices: list, prompt_ids: list[list[int]],
               prompt_texts: list[str], error: str | None = None) -> None:
        """The response is complete (or failed): record every stage and end the request span.
        ``choices``: the response's choices by index (router/openai_api.Choice)."""
        ended = time.monotonic()
        tokenized = self.tokenized or ended
        metrics.stage.labels("tokenize").observe(tokenized - self.started)
        for choice, sequence in zip(choices, self.sequences):
            if sequence.route_started is not None and sequence.route_ended is not None:
                metrics.stage.labels("route").observe(sequence.route_ended - sequence.route_started)
            stages = sequence.stages
            if stages is not None:
                for name in WORKER_STAGES:
                    if name in ("kv_transfer", "decode_queue") and not stages.remote_prefill:
                        continue  # prefilled on the decode worker: no such stage
                    metrics.stage.labels(name).observe(getattr(stages, name))
                metrics.queue_time.labels(self.traffic_class).observe(self.queued_s + stages.prefill_queue
                                                                      + stages.decode_queue)
                if stages.remote_prefill:
                    metrics.kv_transfer.observe(stages.kv_transfer_total)
            if sequence.last_chunk_at is not None:
                metrics.stage.labels("stream").observe(ended - sequence.last_chunk_at)
        if self.root is not None:
            self._end_spans(choices, prompt_ids, prompt_texts, tokenized, ended, error)

    def _end_spans(self, choices: list, prompt_ids: list[list[int]], prompt_texts: list[str], tokenized: float,
                   ended: float, error: str | None) -> None:
        tracing, root = self.tracing, self.root
        parent = trace.set_span_in_context(root)
        tracing.span_at("tokenize", parent, unix_ns(self.started), unix_ns(tokenized),
                        {"tandem.request_id": self.request_id,
                         "tandem.prompt_tokens": sum(len(ids) for ids in prompt_ids)})
        for choice, sequence in zip(choices, self.sequences):
            common = {"tandem.request_id": self.request_id, "tandem.choice": choice.index,
                      "tandem.decode_worker": sequence.decode,
                      "tandem.prefill_worker": sequence.prefill}
            if sequence.route_started is not None and sequence.route_ended is not None:
                tracing.span_at("route", parent, unix_ns(sequence.route_started), unix_ns(sequence.route_ended),
                                {**common, "tandem.attempts": sequence.attempts,
                                 "tandem.prefill": "remote" if sequence.prefill else "local"})
            if sequence.last_chunk_at is not None:
                tracing.span_at("stream", parent, unix_ns(sequence.last_chunk_at), unix_ns(ended), common)
        first = [c.first_token_at for c in choices if c.first_token_at is not None]
        stages = [s.stages for s in self.sequences if s.stages is not None]
        attributes = {
            "gen_ai.usage.input_tokens": sum(len(ids) for ids in prompt_ids),
            "gen_ai.usage.output_tokens": sum(len(c.token_ids) for c in choices),
            "gen_ai.response.finish_reasons": [str(c.finish_reason or FinishReason.ERROR) for c in choices],
            "tandem.time_to_first_token_s": min(first) - self.started if first else None,
            "tandem.time_in_queue_s": self.queued_s + max((s.prefill_queue + s.decode_queue for s in stages),
                                                          default=0.0),
            "tandem.cached_tokens": max((c.num_cached_tokens for c in choices), default=0),
            "tandem.kv_bytes": sum(s.kv_bytes for s in stages),
            "tandem.decode_workers": sorted({s.decode for s in self.sequences if s.decode}),
            "tandem.prefill_workers": sorted({s.prefill for s in self.sequences if s.prefill}),
        }
        if tracing.trace_content:
            attributes["gen_ai.input.messages"] = json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": text}]} for text in prompt_texts])
            attributes["gen_ai.output.messages"] = json.dumps(
                [{"role": "assistant", "parts": [{"type": "text", "content": c.text}],
                  "finish_reason": str(c.finish_reason or FinishReason.ERROR)} for c in choices])
        root.set_attributes({k: v for k, v in attributes.items() if v is not None})
        if error is not None:
            root.set_status(Status(StatusCode.ERROR, error))
        root.end(end_time=unix_ns(ended))

