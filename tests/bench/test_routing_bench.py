"""`tandem bench routing` measures a real decision against a private Redis."""

from __future__ import annotations

from bench.routing_bench import render_routing, routing_latency


def test_routing_bench_picks_the_holder_and_times_it():
    result = routing_latency(num_workers=4, prompt_tokens=512, rounds=20)
    assert result.chose_the_holder and 0 < result.p50_ms <= result.p99_ms
    assert "4 workers, 512-token prompt" in render_routing(result)
