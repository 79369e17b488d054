"""`tandem bench chaos` against a live `tandem serve`, with short windows and four faults: its
accounting adds up, and what it measures holds (no hung or wrong answer, nothing held, the
killed prefill worker back in the pool and taking traffic, every poison request its own 4xx, a
killed router started again serving from the same worker processes)."""

from __future__ import annotations

import re

from bench.chaos import ChaosConfig, render_chaos, run_chaos


def test_chaos_bench_kills_a_prefill_worker_and_sends_poison(smollm_dir):
    cfg = ChaosConfig(model=str(smollm_dir), faults=("kill-prefill", "kill-decode-mid-stream", "poison", "kill-router"),
                      rate=2.0, window_s=15.0, inject_after_s=3.0,
                      serve_args=("--mode", "disagg", "--local-prefill-max-tokens", "0", "--dtype", "float32",
                                  "--max-model-len", "1024", "--num-kv-blocks", "512", "--worker-threads", "1"))
    result = run_chaos(cfg, log=print)
    rows = result.rows
    table = render_chaos(cfg, result)
    print(table)
    assert [row.fault for row in rows] == ["kill-prefill", "kill-decode-mid-stream", "poison", "kill-router"]
    for row in rows:
        assert row.sent > 10 and row.sent == row.completed + row.failed + row.hung + row.wrong + row.other
        assert (row.hung, row.wrong) == (0, 0), row
        # (a killed router's requests end with the connection: the only row with "other" answers)
        assert row.other == 0 or row.fault == "kill-router", row
        assert row.blocks_held and not any(row.blocks_held.values()), row.blocks_held
        # (with its only decode worker killed, arrivals get a 503 until the restart, which may outlast the window)
        assert row.recovered_s is not None or row.fault == "kill-decode-mid-stream"
    kill, mid_stream, poison, router = rows
    assert kill.worker_back_s is not None and kill.worker_back_s > 0 and result.startup_s > 0
    # the streams in flight when their decode worker was killed all moved and completed (issue 23)
    assert any(note.startswith("SIGKILL decode worker") for note in mid_stream.notes), mid_stream.notes
    assert "8 of the 8 streams completed" in " ".join(mid_stream.notes), mid_stream.notes
    assert mid_stream.worker_back_s is not None
    statuses = [int(s) for s in re.search(r"answered \[([^\]]*)\]", poison.notes[0]).group(1).split(", ")]
    assert all(400 <= status < 500 for status in statuses), statuses
    assert f"| kill-prefill | {kill.sent} | {kill.completed} ({kill.near_ties}) |" in table
    assert router.worker_back_s is not None and router.recovered_s is not None
    assert any("from the same 2 worker processes" in note for note in router.notes), router.notes
