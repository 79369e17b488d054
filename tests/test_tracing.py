"""telemetry/: when tracing is on and where it exports, W3C context in gRPC metadata, the gRPC
OTLP exporter against a receiver decoding OTLP protobuf, and the stage arithmetic."""

from __future__ import annotations

import subprocess
import sys

import pytest
from opentelemetry import trace

from engine.request import RequestTimes
from telemetry.stages import decode_stage_times
from telemetry.tracing import (
    Tracing,
    TracingConfig,
    extract,
    inject,
    setup_tracing,
    tracing_config,
    unix_ns,
)
from tests.otlp import GrpcOTLPReceiver


def test_tracing_is_on_only_with_an_endpoint():
    assert tracing_config(None, env={}) is None
    assert tracing_config(None, env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}) is None
    assert tracing_config("http://collector:4317", env={}) == TracingConfig("http://collector:4317", "grpc")
    # the generic variable is a base URL for http/protobuf; the traces one is used as given
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    assert tracing_config(None, env=base).endpoint == "http://collector:4318/v1/traces"
    specific = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:9999/custom"}
    assert tracing_config(None, env=specific).endpoint == "http://other:9999/custom"
    assert tracing_config("collector:4318", env=base).endpoint == "http://collector:4318/v1/traces"
    traces_protocol = {"OTEL_EXPORTER_OTLP_ENDPOINT": "collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                       "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    assert tracing_config(None, env=traces_protocol) == TracingConfig("collector:4317", "grpc")
    assert tracing_config("x", trace_content=True, env={}).trace_content
    with pytest.raises(ValueError, match="OTLP protocol 'http/json'"):
        tracing_config("x", env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_with_tracing_off_no_sdk_and_no_exporter_is_loaded():
    """The router and both workers import without the tracing SDK or any exporter (redis-py
    loads the OpenTelemetry metrics SDK for itself; that is not ours); setup returns None."""
    code = (
        "import sys\n"
        "import router.state, router.app, decode_worker.worker, prefill_worker.worker, cluster.serve\n"
        "from telemetry.tracing import setup_tracing, tracing_config\n"
        "assert tracing_config(None, env={}) is None\n"
        "assert setup_tracing('tandem-router', None) is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter')))\n"
        "assert not loaded, loaded\n"
        "print('clean')\n"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": "."}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0 and "clean" in result.stdout, result.stderr[-2000:]


def test_trace_context_round_trips_through_grpc_metadata():
    tracing = Tracing("tandem-test", TracingConfig("http://127.0.0.1:9", "grpc"))
    try:
        span = tracing.start("request", None, unix_ns(0.0))
        metadata = inject(span)
        assert [key for key, _ in metadata] == ["traceparent"]
        context = extract((("x-tandem-cluster-secret", "s"), *metadata))
        carried = trace.get_current_span(context).get_span_context()
        assert (carried.trace_id, carried.span_id) == (span.get_span_context().trace_id, span.get_span_context().span_id)
        assert inject(None) == ()
        assert extract(None) is None and extract((("other", "x"),)) is None
        assert extract((("traceparent", "not-a-trace-context"),)) is None
    finally:
        tracing.provider.shutdown()


def test_grpc_otlp_exporter_delivers_spans_with_their_service():
    receiver = GrpcOTLPReceiver()
    tracing = setup_tracing("tandem-decode", tracing_config(receiver.endpoint, env={}), "127.0.0.1:1234")
    try:
        root = tracing.start("chat m", None, 1_000_000_000)
        child = tracing.span_at("decode", trace.set_span_in_context(root), 1_100_000_000, 1_900_000_000,
                                {"tandem.request_id": "r-1", "skipped": None}, error="boom")
        root.end(end_time=2_000_000_000)
        assert tracing.flush()
        spans = receiver.wait_for(lambda r: len(r.spans) >= 2 and r.spans, what="both spans")
    finally:
        tracing.shutdown()
        receiver.stop()
    by_name = {s.name: s for s in spans}
    assert {s.service for s in spans} == {"tandem-decode"}
    decode = by_name["decode"]
    assert decode.parent_span_id == by_name["chat m"].span_id == format(root.get_span_context().span_id, "016x")
    assert (decode.start_ns, decode.end_ns) == (1_100_000_000, 1_900_000_000)
    assert decode.attributes == {"tandem.request_id": "r-1"}
    assert decode.status_code == 2  # STATUS_CODE_ERROR
    assert child.get_span_context().trace_id == root.get_span_context().trace_id


def test_decode_stages_tile_the_time_on_the_decode_worker():
    # remote prefill: received 10.0, Prefill call at 10.1, KV landed 11.0 (the sender queued 0.2
    # and prefilled 0.5 of that), joined the batch 11.05, finished 13.0
    times = RequestTimes(scheduled=None, first_token=11.05, finished=13.0, kv_first_chunk=10.5, kv_landed=11.0,
                         sender_queue_s=0.2, sender_prefill_s=0.5, kv_bytes=4096)
    stages = decode_stage_times(10.0, 10.1, times, remote=True)
    assert stages.remote_prefill and stages.kv_bytes == 4096
    assert stages.prefill_queue == pytest.approx(0.2) and stages.prefill == pytest.approx(0.5)
    assert stages.kv_transfer == pytest.approx(0.2)  # 0.9 from the call to landing, less 0.7 on the sender
    assert stages.decode_queue == pytest.approx(0.1 + 0.05)
    assert stages.decode == pytest.approx(1.95)
    assert stages.kv_transfer_total == pytest.approx(0.5)
    parts = stages.prefill_queue + stages.prefill + stages.kv_transfer + stages.decode_queue + stages.decode
    assert parts == pytest.approx(3.0, abs=1e-5)
    # prefilled here (colocated, or the remote KV failed and was recomputed)
    local = decode_stage_times(10.0, None, RequestTimes(scheduled=10.3, first_token=10.8, finished=12.0), remote=False)
    assert not local.remote_prefill and local.kv_transfer == 0 and local.decode_queue == 0
    assert (local.prefill_queue, local.prefill, local.decode) == pytest.approx((0.3, 0.5, 1.2))
