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


def test_kv_scattered_times_tandem_again_on_a_shuffled_pool_and_shows_both(tiny_llama_dir, monkeypatch):
    """--kv-scattered: the same cases on an engine whose KV pool hands out scattered blocks (its
    free queue shuffled, the same pool size for both runs), a column for each and their ratio."""
    import engine.llm as llm_module
    from bench.context_bench import SCATTER_SEED, run_context_bench

    built = []
    original = llm_module.LLM.__init__

    def recording(self, *args, **kwargs):
        built.append((kwargs.get("num_kv_blocks"), kwargs.get("free_order_seed")))
        original(self, *args, **kwargs)

    monkeypatch.setattr(llm_module.LLM, "__init__", recording)
    cfg = ContextBenchConfig(model=str(tiny_llama_dir), dtype="float32", threads=1, context_lens=(24,),
                             batch_sizes=(2,), new_tokens=4, scattered_kv=True)
    result = run_context_bench(cfg, log=lambda *_: None)
    assert [seed for _, seed in built] == [None, SCATTER_SEED] and built[0][0] == built[1][0]
    row = result.rows[0]
    assert row.tandem_ms > 0 and row.tandem_scattered_ms > 0 and row.vllm_ms is None
    lines = render_context(result).splitlines()
    assert lines[1].endswith("| tandem, KV scattered (ms/step) | scattered / in order |")
    assert lines[3] == (f"| 24 | 2 | {row.tandem_ms:.1f} | - | - | {row.tandem_scattered_ms:.1f} | "
                        f"{row.tandem_scattered_ms / row.tandem_ms:.2f} |")
