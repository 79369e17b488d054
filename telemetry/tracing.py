"""OpenTelemetry tracing shared by the router and the workers.

Tracing is on when ``--otlp-endpoint`` or one of the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variables is set; then each process has a ``Tracing``
with its own service name (``tandem-router``, ``tandem-prefill``, ``tandem-decode``), a batch
span processor and an OTLP exporter (gRPC or http/protobuf, as ``OTEL_EXPORTER_OTLP_PROTOCOL``
says). Off, ``setup_tracing`` returns None: the SDK is never imported, no exporter exists and
callers skip every span.

Spans are made after the fact from timestamps a process recorded (``span_at``), so the hot
paths only read a clock. The W3C ``traceparent`` of the router's request span travels in gRPC
metadata (router -> decode worker -> prefill worker): every stage span of a request, in
whichever process, is a child of that one span.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlparse

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ROUTER_SERVICE, PREFILL_SERVICE, DECODE_SERVICE = "tandem-router", "tandem-prefill", "tandem-decode"
_PROTOCOLS = ("grpc", "http/protobuf")
_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = ("traceparent", "tracestate")
# time.monotonic() -> Unix nanoseconds (spans need wall-clock times; durations use the monotonic clock)
_MONO_TO_UNIX_NS = time.time_ns() - time.monotonic_ns()


def unix_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading of this process as Unix nanoseconds."""
    return int(monotonic_s * 1e9) + _MONO_TO_UNIX_NS


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """Resolved once by ``tandem serve`` and handed to every worker it starts."""

    endpoint: str  # grpc: host:port or http(s)://host:port; http/protobuf: the full /v1/traces URL
    protocol: str = "grpc"  # "grpc" | "http/protobuf"
    trace_content: bool = False  # --trace-content: prompt and output text on the router's span

    def __post_init__(self) -> None:
        if self.protocol not in _PROTOCOLS:
            raise ValueError(f"OTLP protocol {self.protocol!r}: use one of {', '.join(_PROTOCOLS)}")
        if not self.endpoint:
            raise ValueError("an OTLP endpoint is required")


def tracing_config(otlp_endpoint: str | None = None, trace_content: bool = False,
                   env: Mapping[str, str] | None = None) -> TracingConfig | None:
    """From ``--otlp-endpoint`` or the standard variables (traces-specific ones first); None
    when neither names an endpoint (tracing off). The protocol defaults to gRPC, as vLLM's."""
    env = os.environ if env is None else env
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip()
    if otlp_endpoint:
        endpoint = _signal_url(otlp_endpoint, protocol)
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        endpoint = env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]  # already the full URL, per the spec
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        endpoint = _signal_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"], protocol)
    else:
        return None
    return TracingConfig(endpoint, protocol, trace_content)


def _signal_url(base: str, protocol: str) -> str:
    """http/protobuf sends traces to <base>/v1/traces (the spec's rule for the generic variable)."""
    if protocol != "http/protobuf":
        return base
    if "://" not in base:
        base = "http://" + base
    if urlparse(base).path.rstrip("/").endswith("/v1/traces"):
        return base
    return base.rstrip("/") + "/v1/traces"


class Tracing:
    """One process's tracer provider and exporter."""

    def __init__(self, service_name: str, config: TracingConfig, instance: str | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.config = config
        self.service_name = service_name
        attributes = {"service.name": service_name, "service.namespace": "tandem"}
        if instance:
            attributes["service.instance.id"] = instance
        self.provider = TracerProvider(resource=Resource.create(attributes))
        self.exporter = _exporter(config)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter, schedule_delay_millis=500))
        self.tracer = self.provider.get_tracer("tandem")

    @property
    def trace_content(self) -> bool:
        return self.config.trace_content

    def start(self, name: str, parent: Context | None, start_ns: int, kind: SpanKind = SpanKind.INTERNAL,
              attributes: Mapping | None = None):
        return self.tracer.start_span(name, context=parent, kind=kind, start_time=start_ns,
                                      attributes=_clean(attributes))

    def span_at(self, name: str, parent: Context | None, start_ns: int, end_ns: int,
                attributes: Mapping | None = None, error: str | None = None):
        """A finished span over [start_ns, end_ns] (Unix ns; a reversed range is clamped)."""
        span = self.tracer.start_span(name, context=parent, start_time=start_ns, attributes=_clean(attributes))
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=max(start_ns, end_ns))
        return span

    def flush(self, timeout_s: float = 5.0) -> bool:
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        self.provider.shutdown()


def _exporter(config: TracingConfig):
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=config.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=config.endpoint)


def setup_tracing(service_name: str, config: TracingConfig | None, instance: str | None = None) -> Tracing | None:
    """This process's Tracing, or None when tracing is off (nothing is created)."""
    return None if config is None else Tracing(service_name, config, instance)


def _clean(attributes: Mapping | None) -> dict | None:
    """OpenTelemetry refuses None values; leave them out."""
    if not attributes:
        return None
    return {key: value for key, value in attributes.items() if value is not None}


# -- W3C trace context in gRPC metadata ----------------------------------------------------------
def inject(parent) -> tuple[tuple[str, str], ...]:
    """gRPC metadata pairs carrying ``parent`` (a Span or a Context); empty for None."""
    if parent is None:
        return ()
    context = trace.set_span_in_context(parent) if isinstance(parent, trace.Span) else parent
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return tuple(carrier.items())


def extract(metadata: Iterable[tuple[str, str]] | None) -> Context | None:
    """The caller's trace context from gRPC metadata; None when it sent none."""
    carrier = {key: value for key, value in (metadata or ()) if key in _TRACE_HEADERS}
    if "traceparent" not in carrier:
        return None
    context = _PROPAGATOR.extract(carrier)
    return context if trace.get_current_span(context).get_span_context().is_valid else None
