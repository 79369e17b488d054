"""`tandem bench served`: the engine side on the tiny model, the served side against the
scripted SSE server (known timings), and the table's arithmetic."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.cpu_noise import Noise, NoisySide
from bench.served_bench import (
    ServedBenchConfig,
    ServedBenchResult,
    ServedRow,
    ServerSide,
    TandemEngineSide,
    make_prompts,
    measure_interleaved,
    render_served,
    request_tpots,
)
from tests.bench.test_serve_bench import RECEIVED, scripted_server, sent_tpot_ms  # noqa: F401 (a fixture)


def test_request_tpot_is_the_time_between_first_and_last_token_per_token():
    first, last = {"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 1.9, "b": 2.5, "c": 3.0}
    assert request_tpots(first, last, Counter(a=10, b=6, c=1)) == pytest.approx([100.0, 100.0])  # c: one token


def test_prompts_are_the_same_ids_for_every_side_and_round_specific():
    cfg = ServedBenchConfig(model="m", streams=(1, 4), prompt_len=7, rounds=2)
    sets = make_prompts(cfg, vocab=1000)
    assert sets == make_prompts(cfg, vocab=1000)
    assert [len(s) for s in sets] == [4, 4] and all(len(p) == 7 for s in sets for p in s)
    assert sets[0] != sets[1]
    assert all(100 <= t < 900 for s in sets for p in s for t in p)


def test_engine_side_times_each_request(tiny_llama_dir):
    cfg = ServedBenchConfig(model=str(tiny_llama_dir), dtype="float32", threads=1, streams=(1, 3), prompt_len=6,
                            output_len=5, rounds=1)
    side = TandemEngineSide(cfg)
    try:
        tpots = side.measure(make_prompts(cfg, vocab=1000)[0][:3], 5)
    finally:
        side.close()
    assert len(tpots) == 3 and all(ms > 0 for ms in tpots)


class _Launched:  # the scripted server, already running
    process = None

    def __init__(self, base_url):
        self.base_url = base_url

    def start(self):
        return self.base_url

    def stop(self):
        pass


def test_server_side_reads_the_streams_timing_and_sends_token_ids(scripted_server):  # noqa: F811
    prompts = make_prompts(ServedBenchConfig(model="m", streams=(2,), prompt_len=5, rounds=1), vocab=1000)[0]
    side = ServerSide("scripted", _Launched(scripted_server), "m", "scripted")
    RECEIVED.clear()
    tpots = side.measure(prompts, 4)
    # against what the script really sent (its sleeps overrun on a busy machine), not its nominal gap
    assert sorted(tpots) == pytest.approx(sorted(sent_tpot_ms(p) for p in prompts), abs=40)
    assert sorted(body["prompt"] for body in RECEIVED) == sorted(prompts)
    assert all(body["max_tokens"] == 4 and body["ignore_eos"] for body in RECEIVED)


class _Side:
    def __init__(self, name, log, ms, everyone):
        self.name, self.log, self.ms, self.paused, self.everyone = name, log, ms, False, everyone

    def pause(self):
        self.paused = True

    def resume(self):
        self.paused = False

    def measure(self, prompts, max_tokens):
        self.log.append((self.name, len(prompts), [s.name for s in self.everyone if not s.paused]))
        return [self.ms * len(prompts)] * len(prompts)


def test_sides_interleave_and_only_the_measured_one_runs():
    log, sides = [], []
    sides += [_Side("a", log, 1.0, sides), _Side("b", log, 2.0, sides)]
    cfg = ServedBenchConfig(model="m", streams=(1, 2), output_len=3, rounds=2)
    cells = measure_interleaved(sides, cfg, make_prompts(cfg, vocab=1000), say=lambda line: None, settle_s=0)
    assert [(name, n) for name, n, _ in log] == [("a", 1), ("b", 1), ("a", 2), ("b", 2)] * 2
    assert all(running == [name] for name, _, running in log)
    assert all(side.paused for side in sides)
    assert cells == {"a": {1: 1.0, 2: 2.0}, "b": {1: 2.0, 2: 4.0}}


def test_table_has_both_overheads_and_the_ratio_to_vllm():
    cfg = ServedBenchConfig(model="m", streams=(8,), vllm_python="python")
    result = ServedBenchResult(cfg, "test machine", [ServedRow(8, 50.0, 55.0, 40.0, 60.0)], {"tandem served": "x"})
    row = render_served(result).splitlines()[3]
    assert row == "| 8 | 50.0 | 55.0 | 1.10 | 40.0 | 60.0 | 1.50 | 0.92 |"


def test_the_noise_table_sets_each_engine_beside_the_noise_against_itself_quiet():
    cfg = ServedBenchConfig(model="m", streams=(8,), vllm_python="python", noise=Noise.parse("900:150"))
    result = ServedBenchResult(cfg, "test machine", [ServedRow(8, 50.0, 55.0, 40.0, 60.0, 60.0, 44.0)], {})
    lines = render_served(result).splitlines()
    assert "900 wake-ups/s x 150 us (13.5% of a core)" in lines[5]
    assert lines[8] == "| 8 | 50.0 | 60.0 | 1.20 | 40.0 | 44.0 | 1.10 |"


@pytest.mark.parametrize("bad", ["900", "0:150", "900:-1", "2000:1000", "a:b"])
def test_noise_that_is_not_a_rate_and_a_work_under_one_core_is_refused(bad):
    with pytest.raises(ValueError, match="noise"):
        Noise.parse(bad)


def test_a_noisy_side_runs_the_noise_only_while_its_engine_is_measured():
    import psutil

    me = psutil.Process()
    before = {child.pid for child in me.children()}  # the session's own (a private Redis, Ray)
    seen = []

    class Engine:
        name, command = "tandem engine", "engine"

        def measure(self, prompts, max_tokens):
            started = [child for child in me.children() if child.pid not in before]
            seen.append([child.cpu_percent(interval=0.5) for child in started])
            return [1.0]

    side = NoisySide(Engine(), Noise(400, 1000))  # 40% of a core
    assert side.name == "tandem engine + noise" and "40.0% of a core" in side.command
    assert side.measure([[1]], 2) == [1.0]
    assert len(seen[0]) == 1 and seen[0][0] > 10  # the noise process computed while the engine ran
    assert {child.pid for child in me.children()} <= before  # and is gone after
