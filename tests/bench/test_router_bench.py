"""`tandem bench router` runs both paths end to end (worker and router in child processes)."""

from __future__ import annotations

from bench.router_bench import render_router, router_overhead


def test_router_overhead_measures_both_paths(smollm_dir):
    rows = router_overhead(str(smollm_dir), [1, 2], max_tokens=4, threads=1, rounds=1)
    assert [row.concurrency for row in rows] == [1, 2]
    assert all(row.grpc_itl_ms > 0 and row.http_itl_ms > 0 for row in rows)
    table = render_router(rows, 1, 4)
    assert "| 2 |" in table and "router adds" in table
