"""Traces and stage metrics of a live disaggregated `tandem serve` (real Ray actors, real gRPC),
exported over OTLP http/protobuf to a receiver this test runs and decoded with the OTLP
protobuf definitions."""

from __future__ import annotations

import httpx
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from telemetry.metrics import STAGES
from tests.router.test_serve import client, prometheus_sum

SERVER_KIND = trace_pb2.Span.SpanKind.SPAN_KIND_SERVER
NUM_LAYERS = 30  # SmolLM2-135M
KV_BYTES_PER_TOKEN = 46080  # float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes
PROMPT = ("[trace] A lighthouse keeper counts the ships that pass each night, writing their names in a "
          "ledger that nobody else has ever read. One night a ship with no name sails by, and")


def _request_trace(receiver, request_id: str, services: int = 3):
    """Every span of the trace whose root carries ``request_id``, once all services sent theirs."""
    def ready(r):
        roots = [s for s in r.spans if s.attributes.get("tandem.request_id") == request_id and not s.parent_span_id]
        if not roots:
            return None
        spans = r.trace(roots[0].trace_id)
        names = {s.name for s in spans}
        if len({s.service for s in spans}) < services or not {"decode", "prefill", "stream"} <= names:
            return None
        return roots[0], spans
    return receiver.wait_for(ready, what=f"the trace of {request_id}")


def test_one_trace_across_router_prefill_and_decode(disagg_server, otlp_receiver):
    response = httpx.post(f"{disagg_server.base_url}/v1/completions", timeout=120,
                          headers={"X-Request-Id": "trace-test-1"},
                          json={"model": "smollm2-135m-instruct", "prompt": PROMPT, "max_tokens": 24,
                                "temperature": 0, "top_p": 0.9, "ignore_eos": True})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    root, spans = _request_trace(otlp_receiver, "trace-test-1")

    # the router's SERVER span is the root; every span belongs to its trace
    assert root.service == "tandem-router" and root.kind == SERVER_KIND
    # its traffic class (no --traffic-classes on this server: the default class, priority 0)
    assert root.attributes["tandem.traffic_class"] == "default" and root.attributes["tandem.priority"] == 0
    assert root.name == "text_completion smollm2-135m-instruct"
    assert {s.trace_id for s in spans} == {root.trace_id}
    by_id = {s.span_id: s for s in spans}
    assert all(s.parent_span_id in by_id for s in spans if s is not root), "a span's parent is missing"

    # each stage span comes from the process that did the work, directly under the root
    services = {"tokenize": "tandem-router", "route": "tandem-router", "stream": "tandem-router",
                "prefill_queue": "tandem-prefill", "prefill": "tandem-prefill", "kv_transfer": "tandem-decode",
                "decode_queue": "tandem-decode", "decode": "tandem-decode"}
    stages = [s for s in spans if s.name in STAGES]
    assert sorted(s.name for s in stages) == sorted([*services, "decode_queue"])  # admission + join
    for span in stages:
        assert span.service == services[span.name], span
        assert span.parent_span_id == root.span_id, span
        assert span.attributes.get("tandem.request_id", "").startswith("trace-test-1"), span

    # the stages tile the request: their sum is its end-to-end latency, within 5%
    e2e = root.seconds
    total = sum(s.seconds for s in stages)
    assert abs(total - e2e) <= 0.05 * e2e, (total, e2e, {s.name: round(s.seconds, 4) for s in stages})
    assert all(root.start_ns <= s.start_ns and s.end_ns <= root.end_ns + 1_000_000 for s in stages)

    # layer-wise KV sends: one span per layer under kv_send, carrying every byte of the prompt's KV
    kv_send = next(s for s in spans if s.name == "kv_send")
    assert kv_send.service == "tandem-prefill" and kv_send.parent_span_id == root.span_id
    layers = [s for s in spans if s.name == "kv_send.layer"]
    assert sorted(s.attributes["tandem.layer"] for s in layers) == list(range(NUM_LAYERS))
    assert all(s.parent_span_id == kv_send.span_id for s in layers)
    expected_bytes = usage["prompt_tokens"] * KV_BYTES_PER_TOKEN
    assert sum(s.attributes["tandem.kv_bytes"] for s in layers) == expected_bytes
    assert root.attributes["tandem.kv_bytes"] == expected_bytes

    # GenAI attributes on the request span, and no text without --trace-content
    attributes = root.attributes
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == "smollm2-135m-instruct"
    assert attributes["gen_ai.request.max_tokens"] == 24
    assert attributes["gen_ai.request.temperature"] == 0.0
    assert attributes["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 24
    assert attributes["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < attributes["tandem.time_to_first_token_s"] < e2e
    assert attributes["tandem.time_in_queue_s"] >= 0
    assert attributes["tandem.cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    decode_span = next(s for s in spans if s.name == "decode")
    prefill_span = next(s for s in spans if s.name == "prefill")
    assert attributes["tandem.decode_workers"] == [decode_span.attributes["tandem.worker"]]
    assert attributes["tandem.prefill_workers"] == [prefill_span.attributes["tandem.worker"]]
    text = response.json()["choices"][0]["text"]
    for span in spans:
        assert "gen_ai.input.messages" not in span.attributes
        assert not any(isinstance(v, str) and ("lighthouse" in v or (text and text in v))
                       for v in span.attributes.values()), span


def test_stage_metrics_count_every_request(disagg_server):
    """Each stage histogram, the queue-time and KV-transfer histograms get one observation per
    (remotely prefilled) request; the transfer failure counter stays put."""
    metrics = lambda: httpx.get(f"{disagg_server.base_url}/metrics", timeout=10).text  # noqa: E731
    before = metrics()
    names = [f'stage="{stage}"' for stage in STAGES]
    counts = lambda text: {n: prometheus_sum(text, "tandem:stage_latency_seconds_count", n) for n in names}  # noqa: E731
    singles = ("tandem:request_queue_time_seconds_count", "tandem:kv_transfer_seconds_count",
               "tandem:e2e_request_latency_seconds_count")
    stage_before = counts(before)
    single_before = {name: prometheus_sum(before, name) for name in singles}
    sums = lambda text: (sum(prometheus_sum(text, "tandem:stage_latency_seconds_sum", n) for n in names),  # noqa: E731
                         prometheus_sum(text, "tandem:e2e_request_latency_seconds_sum"))
    sums_before = sums(before)
    failures_before = prometheus_sum(before, "tandem:kv_transfer_failures_total")
    api = client(disagg_server)
    for i in range(3):
        api.completions.create(model="smollm2-135m-instruct", prompt=f"[stage metrics {i}] Once upon a time",
                               max_tokens=4, temperature=0)
    after = metrics()
    assert {n: c - stage_before[n] for n, c in counts(after).items()} == {n: 3 for n in names}
    assert {name: prometheus_sum(after, name) - single_before[name] for name in singles} == {n: 3 for n in singles}
    assert prometheus_sum(after, "tandem:kv_transfer_failures_total") == failures_before
    # these requests' stages add up to their end-to-end latency (within 5%)
    stage_sum, e2e_sum = (x - y for x, y in zip(sums(after), sums_before))
    assert abs(stage_sum - e2e_sum) <= 0.05 * e2e_sum, (stage_sum, e2e_sum)


def test_a_server_without_an_endpoint_does_not_trace(colocated_server):
    assert any("tracing: off" in line for line in colocated_server.log)
    assert not any("tracing: OTLP" in line for line in colocated_server.log)


def test_grafana_dashboard_queries_metrics_the_server_exposes(disagg_server):
    """Every series the dashboard in deploy/ queries is one that /metrics really serves."""
    import json
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).parents[2] / "deploy/grafana/tandem-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    assert len(exprs) >= 15
    client(disagg_server).completions.create(model="smollm2-135m-instruct", prompt="[dashboard] Hi", max_tokens=2)
    text = httpx.get(f"{disagg_server.base_url}/metrics", timeout=10).text
    served = set(re.findall(r"^(tandem:[a-z0-9_]+)[{ ]", text, re.M))
    queried = {name for expr in exprs for name in re.findall(r"tandem:[a-z0-9_]+", expr)}
    assert queried - served == set()
    for stage in STAGES:  # the stage panels show every stage
        assert f'stage="{stage}"' in httpx.get(f"{disagg_server.base_url}/metrics", timeout=10).text


def test_prefill_workers_run_below_decode_workers_in_cpu_priority(disagg_server):
    """--prefill-nice (default 10): where they share CPUs, decode steps win over prefill."""
    actors = [p for p in disagg_server.descendants() if "WorkerActor" in " ".join(p.cmdline() or [p.name()])]
    assert sorted(p.nice() for p in actors) == [0, 10], [(p.pid, p.name(), p.nice()) for p in actors]


def test_bench_compare_reads_the_stage_totals(disagg_server):
    from bench.compare import stage_totals
    from bench.serve_bench import worker_prompt_tokens_computed

    client(disagg_server).completions.create(model="smollm2-135m-instruct", prompt="[totals] Hi", max_tokens=2)
    totals = stage_totals(f"{disagg_server.base_url}/v1")
    assert set(totals) == set(STAGES) and all(count > 0 and total > 0 for total, count in totals.values())
    assert worker_prompt_tokens_computed(f"{disagg_server.base_url}/v1", "prefill") > 0
