"""``TANDEM_STEP_LOG`` (engine/step_log.py): a line per engine step and per prompt the lane
finished, whose counts add up to what the requests asked for."""

from __future__ import annotations

import json
import os

from cluster.cli import main
from engine.sampling_params import SamplingParams
from engine.step_log import count_runs, summarise
from tests.engine.test_prefill_lane import LANE_MIN, build, long_prompt, run, start_streams

MAX_TOKENS = 12


def test_the_step_log_counts_every_fed_token_once(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_STEP_LOG", str(tmp_path / "steps-{pid}.jsonl"))
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="first")
    short = {f"short{i}": long_prompt(i, 20 + i) for i in range(3)}
    lane = {"lane": long_prompt(9, 3 * LANE_MIN)}
    try:
        assert core.lane is not None
        streams = start_streams(core)  # the lane takes a long prompt only beside decoding streams
        tokens = run(core, list(lane.items()) + list(short.items()))
    finally:
        core.close()
    assert all(len(tokens[name]) == MAX_TOKENS for name in [*short, *lane])
    assert len(streams) == 2 and all(len(tokens[name]) == MAX_TOKENS - 1 for name in streams)

    path = tmp_path / f"steps-{os.getpid()}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    lane_lines = [r for r in records if r["kind"] == "lane"]
    # each request's first token comes from its prompt; each later one was fed back in one step
    assert sum(r["decodes"] for r in steps) == 6 * (MAX_TOKENS - 1)
    # the streams' and the short prompts were read in the steps, the long one in the lane
    assert sum(r["prompt_tokens"] for r in steps) == 2 * 4 + sum(map(len, short.values()))
    assert [r["tokens"] for r in lane_lines] == [len(lane["lane"])] and lane_lines[0]["ms"] > 0
    assert all(r["ms"] > 0 and 0.0 <= r["lane_share"] <= 1.0 for r in steps)
    assert steps[0]["gap_ms"] is None and all(r["gap_ms"] >= 0 for r in steps[1:])
    assert [r["end"] for r in steps] == sorted(r["end"] for r in steps)

    # a prompt line per request, when its first token came: the lane's read in no step
    prompts = {r["tokens"]: r for r in records if r["kind"] == "prompt"}
    assert len([r for r in records if r["kind"] == "prompt"]) == 6
    assert prompts[len(lane["lane"])]["steps"] == 0
    assert all(prompts[len(p)]["steps"] >= 1 for p in short.values())
    assert all(r["queue_ms"] >= 0 and r["read_ms"] >= 0 for r in prompts.values())

    # the one-token sequences' KV: at least a block each, in runs of neighbouring blocks
    assert all(r["kv_blocks"] >= r["kv_runs"] >= (1 if r["decodes"] else 0) for r in steps)
    assert any(r["kv_runs"] for r in steps)

    rows = summarise(path)
    assert sum(row["steps"] for row in rows) == len(steps)
    assert {row["prompt"] for row in rows} == {True, False}
    halves = [summarise(path, part=(index, 2)) for index in range(2)]
    assert sum(row["steps"] for rows_ in halves for row in rows_) == len(steps)
    assert main(["bench", "steps", str(path), "--parts", "2"]) == 0
    printed = capsys.readouterr().out
    assert "| 1 of 2 |" in printed and "| 2 of 2 |" in printed
    assert f"{len(steps)} steps" in printed and "lane: 1 prompts" in printed
    assert "| the lane (or another worker) | 1 |" in printed


def test_runs_of_neighbouring_blocks_either_way():
    assert count_runs([]) == 0 and count_runs([7]) == 1
    assert count_runs([3, 4, 5, 9, 8, 7, 20]) == 3  # ascending, descending, one alone
    assert count_runs([1, 3, 5]) == 3 and count_runs([5, 5]) == 2


def test_no_log_is_written_unless_asked(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("TANDEM_STEP_LOG", raising=False)
    core = build(tiny_llama_dir, None, max_model_len=512)
    try:
        assert core.step_log is None
        core.add_request(core.make_request("r", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2)))
        while core.has_unfinished_requests():
            core.step()
    finally:
        core.close()
