"""`tandem bench kv-transfer` runs end to end and checks that every byte arrived."""

from __future__ import annotations

from bench.kv_transfer_bench import KVTransferBenchResult, overlap, render, throughput


def test_throughput_and_overlap_run(smollm_dir):
    rows = throughput([1], repeats=1)  # each transport asserts the receiver counted every byte
    assert len(rows) == 1
    row = rows[0]
    assert min(row.memcpy_mb_s, row.bare_grpc_mb_s, row.grpc_mb_s, row.gloo_mb_s) > 0
    result = KVTransferBenchResult(rows=rows, overlap=overlap(str(smollm_dir), 96, threads=2))
    assert result.overlap.prefill_s > 0 and result.overlap.exposed_after_s >= 0
    table = render(result)
    assert "| 1 MiB |" in table and "96-token prompt" in table


def test_ttft_comparison_runs_both_paths(smollm_dir):
    from bench.ttft_bench import render_ttft, ttft

    result = ttft(str(smollm_dir), 64, threads=2, rounds=1)
    assert result.colocated_ms > 0 and result.disaggregated_ms > 0
    assert "64-token prompt" in render_ttft(result) and "x colocated" in render_ttft(result)
