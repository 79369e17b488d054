"""`tandem bench context`: tandem's side on the tiny model (timed by the loop vLLM's side shares)
and the table's arithmetic."""

from __future__ import annotations

from bench.context_bench import (
    ContextBenchConfig,
    ContextBenchResult,
    ContextRow,
    make_cases,
    render_context,
    tandem_step_ms,
)


def test_tandem_side_times_one_step_per_case(tiny_llama_dir):
    cfg = ContextBenchConfig(model=str(tiny_llama_dir), dtype="float32", threads=1, context_lens=(8, 24),
                             batch_sizes=(1, 3), new_tokens=5)
    cases = make_cases(cfg, vocab=1000)
    step_ms = tandem_step_ms(cfg, cases)
    assert [(c["context"], c["batch"]) for c in cases] == [(8, 1), (8, 3), (24, 1), (24, 3)]
    assert len(step_ms) == len(cases) and all(0 < ms < 10_000 for ms in step_ms)


def test_table_has_the_ratio_only_where_vllm_ran():
    cfg = ContextBenchConfig(model="m", dtype="bfloat16", threads=2, context_lens=(512,), batch_sizes=(8, 16))
    result = ContextBenchResult(cfg, "test machine", [ContextRow(512, 8, 30.0, 20.0), ContextRow(512, 16, 45.0)])
    lines = render_context(result).splitlines()
    assert lines[3] == "| 512 | 8 | 30.0 | 20.0 | 1.50 |"
    assert lines[4] == "| 512 | 16 | 45.0 | - | - |"
