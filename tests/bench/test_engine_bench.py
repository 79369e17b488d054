"""`tandem bench engine` runs end to end and its table is computed from what it measured."""

from __future__ import annotations

import json

import pytest

from bench.engine_bench import EngineBenchConfig, render_table, run_engine_bench, to_json
from engine.kernels import block_linear


@pytest.fixture(scope="module")
def result(smollm_dir):
    cfg = EngineBenchConfig(model=str(smollm_dir), dtypes=("float32",), threads=2, prompt_len=48,
                            batch_sizes=(1, 2), decode_tokens=4, decode_prompt_len=8)
    return run_engine_bench(cfg, log=lambda _line: None)


def test_bench_measures_both_sides(result):
    assert [(r.metric, r.batch) for r in result.rows] == [("prefill", 1), ("decode", 1), ("decode", 2)]
    for row in result.rows:
        assert row.tandem_tok_s > 0 and row.transformers_tok_s > 0
        assert row.ratio == pytest.approx(row.tandem_tok_s / row.transformers_tok_s)
    decode = result.rows[1]
    # roofline follows from the measured bandwidth and the weights a step reads
    weight_bytes = result.weight_bytes["float32"]
    if block_linear.load() is not None:  # the matrices' exact blocks: Q4_1 at 6 bits, the head Q8_0 at 9
        assert 0.6 * 135e6 < weight_bytes < 135e6
    else:
        assert 4 * 100e6 < weight_bytes < 4 * 200e6  # ~135M float32 parameters
    assert decode.roofline_tok_s < result.bandwidth_gb_s * 1e9 / weight_bytes
    assert decode.roofline_tok_s > 0.9 * result.bandwidth_gb_s * 1e9 / weight_bytes
    assert result.auto_dtype in ("float32", "bfloat16")
    # a 1024-row float32 matmul on 2 cores: well above a decode step's, well below 1 TFLOP/s
    assert 1 < result.gemm_peak_gflops["float32"] < 1000


def test_table_and_json(result):
    table = render_table(result)
    assert "| float32 | decode batch 2 |" in table and "memory read bandwidth" in table
    assert f"float32 {result.gemm_peak_gflops['float32']:.0f} GFLOP/s" in table
    # without --vllm-python the vLLM columns are empty, not zero
    assert all(row.vllm_tok_s is None for row in result.rows) and "vLLM:" not in table
    data = json.loads(to_json(result))
    assert data["rows"][0]["ratio"] == pytest.approx(result.rows[0].ratio)
