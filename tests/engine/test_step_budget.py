"""Chunking bounded by time: the step budget's arithmetic, the scheduler under it, and the
engine's tokens with it (DESIGN.md's token-equality rule against the unchunked engine)."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.step_budget import CHUNK_TOKEN_BUCKETS, StepBudget, StepBudgetConfig, StepShape, StreamPace
from tests.engine.test_scheduler import make_request, run_step
from tests.reference import EqualityStats, assert_same_as_engine_reference


def test_without_a_target_or_without_decodes_prompts_get_the_token_cap():
    off = StepBudget(StepBudgetConfig(max_num_batched_tokens=512, max_step_ms=None))
    off.observe(StepShape(num_decodes=4, num_prompt_tokens=0, elapsed_s=0.040))
    assert off.prompt_tokens(num_decodes=4) == 512
    timed = StepBudget(StepBudgetConfig(max_num_batched_tokens=512, max_step_ms=50))
    assert timed.prompt_tokens(num_decodes=0) == 512  # nothing waits on the step


def test_chunk_follows_the_measured_decode_time_and_prompt_rate():
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=4096, max_step_ms=100, min_chunk_tokens=16,
                                         smoothing=1.0))
    assert budget.prompt_tokens(num_decodes=8) == 16  # nothing timed yet: the minimum
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.040))
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=100, elapsed_s=0.090))  # 0.5 ms per prompt token
    assert budget.decode_ms == pytest.approx(40) and budget.ms_per_prompt_token == pytest.approx(0.5)
    assert budget.prompt_tokens(num_decodes=8) == 120  # (100 - 40) / 0.5
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.095))  # decoding got slower
    assert budget.prompt_tokens(num_decodes=8) == 16  # 5 ms left: the minimum still moves the prompt
    budget.observe(StepShape(num_decodes=0, num_prompt_tokens=1000, elapsed_s=0.001))  # a very fast prefill
    budget.observe(StepShape(num_decodes=0, num_prompt_tokens=0, elapsed_s=0.5))  # an empty step teaches nothing
    assert budget.prompt_tokens(num_decodes=1) == 4096  # capped


def test_moving_average_smooths_one_slow_step():
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=4096, max_step_ms=100, smoothing=0.25))
    budget.observe(StepShape(num_decodes=2, num_prompt_tokens=100, elapsed_s=0.100))  # 1 ms per token
    budget.observe(StepShape(num_decodes=2, num_prompt_tokens=100, elapsed_s=0.500))  # one outlier: 5 ms
    assert budget.ms_per_prompt_token == pytest.approx(1 + 0.25 * 4)


def test_chunk_histogram_counts_each_step_in_its_bucket():
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=1 << 16, max_step_ms=None))
    for tokens in (1, 16, 17, 9000, 20000):
        budget.observe(StepShape(num_decodes=0, num_prompt_tokens=tokens, elapsed_s=0.01))
    counts = dict(zip([*CHUNK_TOKEN_BUCKETS, "inf"], budget.chunk_counts))
    assert counts[16] == 2 and counts[32] == 1 and counts[16384] == 1 and counts["inf"] == 1
    assert sum(budget.chunk_counts) == 5 and budget.chunk_sum == 1 + 16 + 17 + 9000 + 20000


@pytest.mark.parametrize("bad", [0, -5, float("nan")])
def test_a_target_must_be_positive(bad):
    with pytest.raises(ValueError, match="max_step_ms"):
        SchedulerConfig(max_step_ms=bad)


def test_scheduler_gives_prompt_chunks_what_the_target_leaves_beside_decodes():
    kv = KVCacheManager(BlockPool(64), 4, namespace=b"test", enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_step_ms=100), kv, 512)
    sched.step_budget.config = StepBudgetConfig(64, 100, min_chunk_tokens=4, smoothing=1.0)
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 6, max_tokens=50))
    out, _ = run_step(sched)
    assert out.num_decodes == 0 and out.num_batched_tokens == 12  # no decodes yet: both prompts whole
    sched.add_request(make_request("long", 100, max_tokens=2))
    out, _ = run_step(sched)  # nothing timed yet: the minimum chunk beside two decodes
    assert out.num_decodes == 2 and [len(s.token_ids) for s in out.seqs] == [1, 1, 4]
    sched.step_budget.observe(StepShape(num_decodes=2, num_prompt_tokens=0, elapsed_s=0.040))
    sched.step_budget.observe(StepShape(num_decodes=2, num_prompt_tokens=10, elapsed_s=0.060))  # 2 ms/token
    out, _ = run_step(sched)
    assert [len(s.token_ids) for s in out.seqs] == [1, 1, 30]  # (100 - 40) / 2
    first = out.seqs[2].start_pos
    sched.step_budget.observe(StepShape(num_decodes=2, num_prompt_tokens=10, elapsed_s=0.020))  # 0.0 -> floor
    while sched.requests["long"].num_computed_tokens < 100:
        out, _ = run_step(sched)
        assert out.num_batched_tokens <= 64 and out.num_decodes == 2
    assert first == 4  # the chunks were contiguous from where the minimum chunk ended
    for rid in list(sched.requests):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == 64


def test_time_bounded_chunks_keep_the_engines_tokens(smollm_dir):
    """Two streams decoding while two long prompts arrive, under a 1 ms target (so every
    chunk beside a decode is the 16-token minimum), against the same prompts generated by an
    engine with the token cap only. Greedy tokens equal under DESIGN.md's rule."""
    from tests.conftest import make_llm

    kwargs = dict(model=str(smollm_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=2)
    timed, plain = make_llm(max_step_ms=1.0, **kwargs), make_llm(**kwargs)
    prompts = [[(17 * i + 31 * j) % 40000 + 1000 for j in range(length)] for i, length in enumerate((12, 20, 300, 450))]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    core = timed.engine_core
    for i, prompt in enumerate(prompts[:2]):
        core.add_request(core.make_request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    step = 0
    while core.has_unfinished_requests():
        if step == 3:  # the long prompts arrive while the streams decode
            for i, prompt in enumerate(prompts[2:], start=2):
                core.add_request(core.make_request(f"r{i}", prompt, params))
        for output in core.step():
            tokens[output.request_id].extend(output.new_token_ids)
        step += 1
    counts = core.scheduler.step_budget.chunk_counts
    assert counts[0] >= 20  # most of the 750 prompt tokens went 16 at a time beside the decodes
    reference = plain.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = EqualityStats()
    for i, out in enumerate(reference):
        assert_same_as_engine_reference(tokens[f"r{i}"], out.outputs[0], stats, f"r{i}")
    assert stats.compared == 4 and stats.near_ties <= 1, stats


def test_the_streams_pace_is_the_mean_interval_between_decoding_steps_in_its_window():
    pace = StreamPace(window_s=2.0)
    assert pace.ms(100.0) is None  # nothing decoded yet
    pace.observe(100.0)
    assert pace.ms(100.01) is None  # one step has no interval
    for index in range(1, 11):
        pace.observe(100.0 + 0.05 * index)  # ten steps 50 ms apart
    assert pace.ms(100.5) == pytest.approx(50.0)
    assert pace.ms(100.52) == pytest.approx(50.0)  # the step under way has taken 20 ms: not late yet
    # a step under way for 450 ms (a prompt in it) counts as if it ended now: the streams wait already
    assert pace.ms(100.95) == pytest.approx(950.0 / 11)
    pace.observe(101.0)  # it ended
    assert pace.ms(101.0) == pytest.approx(1000.0 / 11)
    # 2 s on, what came before the window is forgotten
    pace.observe(103.0)
    pace.observe(103.02)
    assert pace.ms(103.02) == pytest.approx(20.0)
    assert pace.ms(106.0) is None  # the streams are gone: no pace
    assert pace.ms(103.03) == pytest.approx(20.0)  # reading forgets nothing (Stats reads it from another thread)


def test_the_step_budget_learns_the_pace_from_decoding_steps_only():
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=512, max_step_ms=100.0))
    for index in range(5):
        budget.observe(StepShape(num_decodes=4, num_prompt_tokens=0, elapsed_s=0.03, ended_at=10.0 + 0.03 * index))
    budget.observe(StepShape(num_decodes=0, num_prompt_tokens=300, elapsed_s=0.3, ended_at=10.5))  # no stream waited
    assert budget.pace.ms(10.12) == pytest.approx(30.0)
    budget.observe(StepShape(num_decodes=4, num_prompt_tokens=200, elapsed_s=0.25, ended_at=10.37))
    assert budget.pace.ms(10.37) == pytest.approx(370.0 / 5)


def test_the_lane_tradeoff_measures_both_sides_from_steps_apart_from_and_beside_the_lane():
    """LaneTradeoff's arithmetic (the ``cost`` lane policy's inputs): decode-only steps apart
    from the lane set the baseline, those beside it the slowdown against the baseline of the
    time, prompt steps apart from it the steps' cost per prompt token; steps that shared
    their time with the lane only in part teach it nothing, and prompt steps beside it only
    their own cost per token."""
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=512, max_step_ms=500.0, smoothing=0.5))
    tradeoff = budget.tradeoff
    assert tradeoff.lane_ms(0.9) is None and tradeoff.step_ms_per_token is None  # nothing measured
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.060, lane_share=1.0, ended_at=1.0))
    assert tradeoff.slowdown is None  # beside the lane, but no step apart from it to compare with yet
    for elapsed_s in (0.040, 0.040):
        budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=elapsed_s, lane_share=0.0, ended_at=2.0))
    assert tradeoff.decode_ms_apart == pytest.approx(40.0)
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.060, lane_share=0.95, ended_at=3.0))
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.500, lane_share=0.5, ended_at=4.0))
    assert tradeoff.slowdown == pytest.approx(60.0 / 40.0) and tradeoff.beside_at == 3.0
    # a prompt token in the lane at 0.9 ms on its thread costs the streams the third of it the steps lose
    assert tradeoff.lane_ms(0.9) == pytest.approx(0.9 * (1 - 40.0 / 60.0))
    assert tradeoff.lane_ms(None) is None  # the lane has computed no prompt of its own yet
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=100, elapsed_s=0.090, lane_share=0.0, ended_at=5.0))
    assert tradeoff.step_ms_per_token == pytest.approx((90.0 - 40.0) / 100) and tradeoff.prompt_apart_at == 5.0
    budget.observe(StepShape(num_decodes=0, num_prompt_tokens=200, elapsed_s=0.040, lane_share=0.0, ended_at=6.0))
    # nothing decoded: all of it; weighted by tokens, the 200 count twice the 100
    assert tradeoff.step_ms_per_token == pytest.approx((0.5 * 50.0 + 0.5 * 40.0) / (0.5 * 100 + 0.5 * 200))
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=100, elapsed_s=0.900, lane_share=1.0, ended_at=7.0))
    # beside the lane: apart from the steps apart from it, its decode part the slowed baseline (40 x 1.5)
    assert tradeoff.prompt_apart_at == 6.0 and tradeoff.step_ms_per_token == pytest.approx(0.3)
    assert tradeoff.step_ms_per_token_beside == pytest.approx((900.0 - 60.0) / 100)
    # a step beside the lane that beat the baseline: the lane costs the streams nothing, never less
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.010, lane_share=1.0, ended_at=8.0))
    budget.observe(StepShape(num_decodes=8, num_prompt_tokens=0, elapsed_s=0.010, lane_share=1.0, ended_at=9.0))
    assert tradeoff.slowdown < 1.0 and tradeoff.lane_ms(0.9) == 0.0


def test_the_steps_time_for_a_prompt_is_its_chunks_decode_parts_and_tokens_at_the_measured_costs():
    """StepBudget.prompt_ms (the prefill lane's TTFT guard compares the lane with it): one decode
    part per step the prompt's chunks take, each token at its marginal cost; the costs of steps
    apart from the lane, or of steps beside it (StepBudget.costs)."""
    budget = StepBudget(StepBudgetConfig(max_num_batched_tokens=4096, max_step_ms=100, smoothing=1.0))
    assert budget.prompt_ms(200, num_decodes=4) is None  # no prompt step timed yet
    budget.observe(StepShape(num_decodes=4, num_prompt_tokens=0, elapsed_s=0.040, lane_share=0.0))
    budget.observe(StepShape(num_decodes=4, num_prompt_tokens=120, elapsed_s=0.100, lane_share=0.0))  # 0.5 ms a token
    assert budget.prompt_tokens(num_decodes=4) == 120
    assert budget.prompt_ms(200, num_decodes=4) == pytest.approx(2 * 40 + 200 * 0.5)  # chunks of 120 and 80
    assert budget.prompt_ms(120, num_decodes=4) == pytest.approx(40 + 120 * 0.5)
    assert budget.prompt_ms(0, num_decodes=4) == 0.0
    assert budget.prompt_ms(200, num_decodes=0) == pytest.approx(200 * 0.5)  # one pass, nothing decodes beside it
    # beside the lane: the decode part is the slowed baseline, a prompt token costs what prompt
    # steps beside it measured (before any, the cost apart times the slowdown); apart, nothing moves
    budget.observe(StepShape(num_decodes=4, num_prompt_tokens=0, elapsed_s=0.060, lane_share=1.0))
    assert budget.tradeoff.slowdown == pytest.approx(1.5)
    assert budget.costs(beside_lane=True) == pytest.approx((60.0, 0.75))
    assert budget.prompt_tokens(num_decodes=4, beside_lane=True) == int((100 - 60) / 0.75)
    budget.observe(StepShape(num_decodes=4, num_prompt_tokens=100, elapsed_s=0.300, lane_share=1.0))
    assert budget.costs(beside_lane=True) == pytest.approx((60.0, (300.0 - 60.0) / 100))
    assert budget.costs() == pytest.approx((40.0, 0.5)) and budget.prompt_tokens(num_decodes=4) == 120
    assert budget.prompt_tokens(num_decodes=4, beside_lane=True) == 16  # (100 - 60) / 2.4, and the minimum
    assert budget.prompt_ms(200, num_decodes=4) == pytest.approx(2 * 40 + 200 * 0.5)
    assert budget.prompt_ms(200, num_decodes=4, beside_lane=True) == pytest.approx(13 * 60 + 200 * 2.4)
