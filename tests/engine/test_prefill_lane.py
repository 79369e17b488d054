"""The prefill lane (engine/prefill_lane.py): a long prompt computed on a thread of its own while
the engine thread keeps decoding. Its tokens are the tokens of the ordinary steps and of
transformers, the streams keep their pace while it runs, and an abort or a failed forward
there leaves no block behind and no other request touched."""

from __future__ import annotations

import functools
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.engine_loop import AddRequest, EngineLoop
from engine.kv_cache.block_hash import namespace_digest
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.llm import EngineArgs
from engine.remote_kv import KVFailurePolicy
from engine.sampling_params import SamplingParams
from engine.step_budget import LaneTradeoff
from proto.convert import worker_stats
from tests.reference import EqualityStats, assert_token_equal, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LANE_MIN = 64


def long_prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + index * 31) % 40000 + 5 for index in range(length)]


def build(model_dir, lane: int | None, **kwargs):
    args = dict(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024, num_threads=2,
                prefill_lane_min_tokens=lane)
    args.update(kwargs)
    return EngineArgs(**args).build_core()


def start_streams(core, count: int = 2, params: SamplingParams = GREEDY) -> dict[str, list[int]]:
    """Streams that decode from the next step on; their first tokens."""
    for index in range(count):
        core.add_request(core.make_request(f"s{index}", [200 + index, 17, 99, 4000 + index], params))
    return {output.request_id: list(output.new_token_ids) for output in core.step()}


def run(core, requests: list[tuple[str, list[int]]], gate=None) -> dict[str, list[int]]:
    """Step until every request is done; the tokens each one got."""
    for request_id, prompt in requests:
        core.add_request(core.make_request(request_id, prompt, GREEDY))
    tokens: dict[str, list[int]] = {}
    deadline = time.monotonic() + 300
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        for output in core.step():
            assert output.error is None, output.error
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if not core.scheduler.running:
            time.sleep(0.001)  # only the lane has work
    return tokens


def step_into(core, tokens: dict[str, list[int]]) -> None:
    """One engine step; each request's new tokens go into ``tokens``."""
    for output in core.step():
        assert output.error is None, output.error
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)


def drain(core, step) -> None:
    """``step()`` until the engine has nothing left (within two minutes); every block is back."""
    deadline = time.monotonic() + 120
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish its requests"
        step()
    core.check_integrity()
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks


def assert_plain_engines_tokens(model_dir, streams: SamplingParams, prompts: dict[str, list[int]],
                                tokens: dict[str, list[int]]) -> None:
    """The prompts' tokens are those of an engine without a lane, beside the same two streams."""
    plain = build(model_dir, None, max_model_len=512)
    try:
        start_streams(plain, params=streams)
        reference = run(plain, list(prompts.items()))
    finally:
        plain.close()
    for name in prompts:
        assert tokens[name] == reference[name], name


def wrap_lane(core, before=None):
    """Count the prompts the lane computes (request id, prompt tokens, thread) and run ``before``
    on its thread before each. A prompt read in halves (split_prompt) counts once: its first
    half, which samples nothing, then its second."""
    runner = core.lane.runner
    execute_layers, seen, first_half = runner.execute_layers, [], []

    def recording(step):
        seq = step.seqs[0]
        if first_half and first_half.pop() == seq.request_id:  # the second half of the prompt just counted
            request_id, tokens, thread = seen[-1]
            seen[-1] = (request_id, tokens + len(seq.token_ids), thread)
            return execute_layers(step)
        if seq.sampling is None:
            first_half.append(seq.request_id)
        seen.append((seq.request_id, len(seq.token_ids), threading.current_thread().name))
        if before is not None:
            before()
        return execute_layers(step)

    runner.execute_layers = recording
    return seen


def held_lane(core):
    """The lane made to wait before each prompt until ``release`` is set; returns ``release``,
    what the lane computed (``wrap_lane``), the tokens each request got, and a step that
    collects them."""
    release = threading.Event()
    seen = wrap_lane(core, lambda: release.wait(60))
    tokens: dict[str, list[int]] = {}
    return release, seen, tokens, functools.partial(step_into, core, tokens)


@pytest.fixture(scope="module")
def lane_core(smollm_dir):
    core = build(smollm_dir, LANE_MIN)
    yield core
    core.close()


@pytest.fixture(autouse=True)
def _lane_core_clean(request):
    yield
    if "lane_core" in request.fixturenames:
        core = request.getfixturevalue("lane_core")
        core.check_integrity()
        assert not core.has_unfinished_requests()
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
        core.lane.runner.__dict__.pop("execute_layers", None)  # undo wrap_lane


def test_lane_tokens_are_the_steps_tokens_and_transformers(lane_core, smollm_dir, hf_smollm):
    prompts = [("long0", long_prompt(1, 300)), ("long1", long_prompt(2, 200)), ("short", long_prompt(3, 20))]
    seen = wrap_lane(lane_core)
    start_streams(lane_core)
    with_lane = run(lane_core, prompts)
    assert {request_id for request_id, _, _ in seen} >= {"long0"}  # it took the long prompts...
    assert all(name == "prefill-lane" and length >= LANE_MIN for _, length, name in seen)
    assert "short" not in {request_id for request_id, _, _ in seen}  # ...and left the short one to the steps

    plain = build(smollm_dir, None)
    try:
        assert plain.lane is None
        start_streams(plain)
        without = run(plain, prompts)
    finally:
        plain.close()
    assert with_lane == without
    model, _ = hf_smollm
    reference, logits = hf_greedy(model, prompts[0][1], GREEDY.max_tokens)
    assert_token_equal(with_lane["long0"], reference, logits, EqualityStats(), "long0 in the lane")


def test_streams_decode_on_fewer_threads_while_the_lane_runs(lane_core):
    release, entered = threading.Event(), threading.Event()
    threads_in_lane = []

    def hold():
        threads_in_lane.append(torch.get_num_threads())
        entered.set()
        assert release.wait(60)

    seen = wrap_lane(lane_core, hold)
    streams = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    start_streams(lane_core, params=streams)
    lane_core.add_request(lane_core.make_request("long", long_prompt(4, 200), GREEDY))
    lane_core.step()
    assert entered.wait(30) and lane_core.lane.busy
    assert threads_in_lane == [1] and torch.get_num_threads() == 1  # the engine thread lent it one
    # the next long prompt is queued in the lane behind it (depth 2); the one after that waits
    # at the head of the queue for the lane instead of stalling the streams, and so does what
    # arrives after it
    for request_id, length in (("next", 150), ("third", 120), ("after", 10)):
        lane_core.add_request(lane_core.make_request(request_id, long_prompt(len(request_id), length), GREEDY))
    decoded = []
    for _ in range(5):  # the streams go on while the lane holds its prompts
        decoded += [output.request_id for output in lane_core.step() if output.new_token_ids]
        assert lane_core.lane.pending == ["long", "next"]
        for request_id in ("next", "third", "after"):
            assert lane_core.scheduler.requests[request_id].num_computed_tokens == 0
    assert decoded.count("s0") == 5 and decoded.count("s1") == 5 and set(decoded) == {"s0", "s1"}
    release.set()
    # the lane starts the queued prompt by itself, with no engine step between the two
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, "the lane did not start its queued prompt"
        time.sleep(0.001)
    assert [request_id for request_id, _, _ in seen] == ["long", "next"]
    tokens = run(lane_core, [])
    assert all(len(tokens[r]) == GREEDY.max_tokens for r in ("long", "next", "third", "after"))
    assert [request_id for request_id, _, _ in seen] == ["long", "next", "third"]
    assert torch.get_num_threads() == 2  # the thread came back


def test_an_abort_while_the_lane_writes_keeps_its_blocks_until_the_lane_is_done(lane_core):
    release, entered = threading.Event(), threading.Event()
    wrap_lane(lane_core, lambda: (entered.set(), release.wait(60)))
    start_streams(lane_core)
    free_before = lane_core.block_pool.num_free_blocks
    lane_core.add_request(lane_core.make_request("long", long_prompt(5, 250), GREEDY))
    lane_core.step()
    assert entered.wait(30)
    output = lane_core.abort_request("long")
    assert output.finish_reason == "abort"
    lane_core.check_integrity()
    # its 16 blocks are still out of the pool: the lane may still write into them
    assert lane_core.block_pool.num_free_blocks <= free_before - 16
    release.set()
    tokens = run(lane_core, [])
    assert "long" not in tokens
    assert lane_core.block_pool.num_free_blocks == lane_core.block_pool.num_blocks


def test_stats_count_the_lanes_prompts_apart_from_those_waiting_for_remote_kv(lane_core):
    release, entered = threading.Event(), threading.Event()
    wrap_lane(lane_core, lambda: (entered.set(), release.wait(60)))
    start_streams(lane_core)
    lane_core.add_request(lane_core.make_request("long", long_prompt(21, 200), GREEDY))
    lane_core.add_request(lane_core.make_request("queued", long_prompt(22, 150), GREEDY))
    lane_core.step()
    assert entered.wait(30) and lane_core.lane.pending == ["long", "queued"]
    remote = lane_core.make_request("remote", long_prompt(23, 64), GREEDY)
    try:
        assert lane_core.add_remote_request(remote, 60.0, KVFailurePolicy.RECOMPUTE) == 0
        stats = worker_stats(lane_core, "decode", "here")
        # both sit in the scheduler's remote-KV table, but only "remote" waits for a transfer
        assert (stats.num_in_lane, stats.num_waiting_for_remote_kv) == (2, 1)
        assert len(lane_core.scheduler.waiting_for_remote_kv) == 3
    finally:
        lane_core.abort_request("remote")
        release.set()
    tokens = run(lane_core, [])
    assert len(tokens["long"]) == len(tokens["queued"]) == GREEDY.max_tokens
    stats = worker_stats(lane_core, "decode", "here")
    assert (stats.num_in_lane, stats.num_waiting_for_remote_kv, stats.num_waiting) == (0, 0, 0)


def test_an_abort_of_a_prompt_queued_in_the_lane_skips_it(lane_core):
    release, entered = threading.Event(), threading.Event()
    seen = wrap_lane(lane_core, lambda: (entered.set(), release.wait(60)))
    start_streams(lane_core)
    lane_core.add_request(lane_core.make_request("long", long_prompt(17, 200), GREEDY))
    lane_core.add_request(lane_core.make_request("queued", long_prompt(18, 150), GREEDY))
    lane_core.step()
    assert entered.wait(30) and lane_core.lane.pending == ["long", "queued"]
    assert lane_core.abort_request("queued").finish_reason == "abort"
    release.set()
    tokens = run(lane_core, [])
    assert [request_id for request_id, _, _ in seen] == ["long"]  # never computed
    assert "queued" not in tokens and len(tokens["long"]) == GREEDY.max_tokens
    assert lane_core.block_pool.num_free_blocks == lane_core.block_pool.num_blocks


def test_a_failed_lane_forward_fails_that_request_alone(lane_core):
    def boom():
        raise RuntimeError("injected lane failure")

    wrap_lane(lane_core, boom)
    tokens = start_streams(lane_core)
    lane_core.add_request(lane_core.make_request("long", long_prompt(6, 200), GREEDY))
    errors = {}
    while lane_core.has_unfinished_requests():
        for output in lane_core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.error:
                errors[output.request_id] = output.error
        time.sleep(0.001)
    assert list(errors) == ["long"] and "injected lane failure" in errors["long"]
    assert len(tokens["s0"]) == len(tokens["s1"]) == GREEDY.max_tokens


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names for the OS are set on Linux only")
def test_the_lane_thread_carries_its_name_to_the_os(lane_core):
    comm = Path(f"/proc/self/task/{lane_core.lane._thread.native_id}/comm").read_text().strip()
    assert comm == "prefill-lane"  # top -H and py-spy tell it from the engine thread


def test_no_lane_without_threads_to_lend_or_on_the_offline_engine(smollm_dir, tiny_llama_dir):
    threads = torch.get_num_threads()
    try:
        assert build(tiny_llama_dir, LANE_MIN, num_threads=1, max_model_len=512).lane is None
    finally:
        torch.set_num_threads(threads)
    offline = EngineArgs(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                         num_threads=2).build_core()
    assert offline.lane is None
    with pytest.raises(ValueError, match="prefill_lane_min_tokens"):
        build(tiny_llama_dir, 0, max_model_len=512)


def test_the_lane_takes_only_the_queue_head_when_it_is_a_fresh_long_prompt_and_streams_decode(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512)
    try:
        scheduler = core.scheduler
        core.add_request(core.make_request("alone", long_prompt(7, 100), GREEDY))
        assert scheduler.take_for_lane() is None  # nothing decodes: the step takes it on every thread
        run(core, [])
        start_streams(core)
        core.add_request(core.make_request("short", long_prompt(8, 20), GREEDY))
        core.add_request(core.make_request("long", long_prompt(9, 100), GREEDY))
        assert scheduler.take_for_lane() is None  # the head is short; the long one keeps its turn
        core.abort_request("short")
        logprobs = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
        core.abort_request("long")
        core.add_request(core.make_request("scored", long_prompt(10, 100), logprobs))
        assert scheduler.take_for_lane() is None  # prompt logprobs are scored in the steps
        core.abort_request("scored")
        core.add_request(core.make_request("long", long_prompt(9, 100), GREEDY))
        seq = scheduler.take_for_lane()
        assert seq is not None and seq.request_id == "long" and seq.start_pos == 0 and len(seq.token_ids) == 100
        assert seq.sampling is not None and seq.sampling.position == 100
        assert scheduler.requests["long"].status.name == "WAITING_FOR_REMOTE_KV"
        core.abort_request("long")
        run(core, [])
        core.check_integrity()
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    finally:
        core.close()


def test_a_pinned_requests_blocks_go_back_only_when_unpinned():
    pool = BlockPool(8)
    manager = KVCacheManager(pool, 4, namespace_digest("m", 4, "float32"))
    assert manager.allocate_slots("r", 10)
    manager.pin("r")
    manager.free("r")
    assert pool.num_free_blocks == 5 and manager.block_table("r") == []
    manager.check_integrity()
    assert manager.allocate_slots("r2", 12)  # the rest of the pool serves others meanwhile
    manager.free("r2")
    manager.unpin("r")
    assert pool.num_free_blocks == 8
    manager.check_integrity()
    manager.unpin("r")  # idempotent


def test_an_engine_loop_with_a_lane_serves_long_prompts_beside_streams(smollm_dir):
    loop = EngineLoop(lambda: build(smollm_dir, LANE_MIN))
    finished: dict[str, threading.Event] = {}
    tokens: dict[str, list[int]] = {}

    def listener(output):
        tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if output.finish_reason:
            finished[output.request_id].set()

    seen = wrap_lane(loop.core)
    loop.start()
    try:
        streams = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        for request_id, prompt, params in [("s0", [5, 6, 7], streams), ("long", long_prompt(11, 300), GREEDY)]:
            finished[request_id] = threading.Event()
            loop.add(AddRequest(request_id, prompt, params, listener)).result(30)
            time.sleep(0.3)  # the stream decodes before the long prompt arrives
        assert all(event.wait(120) for event in finished.values())
    finally:
        loop.stop()
    assert [request_id for request_id, _, _ in seen] == ["long"]
    assert len(tokens["long"]) == GREEDY.max_tokens and len(tokens["s0"]) == 200
    loop.core.check_integrity()
    assert loop.core.block_pool.num_free_blocks == loop.core.block_pool.num_blocks


def test_a_lane_prompts_first_token_goes_out_before_the_next_forward(smollm_dir):
    """The engine loop sends the first token of a prompt the lane finished as soon as it takes
    it back, not after the next step's forward (which already decodes its second token)."""
    loop = EngineLoop(lambda: build(smollm_dir, LANE_MIN))
    events: list[tuple[str, object]] = []  # appended on the engine thread only, in order
    done = threading.Event()
    execute = loop.core.runner.execute  # the steps' runner; the lane has a runner of its own

    def recording(step):
        events.append(("forward", {seq.request_id for seq in step.seqs}))
        return execute(step)

    def listener(output):
        if output.new_token_ids:
            events.append(("out", output.request_id))
        if output.request_id == "long" and output.finish_reason:
            done.set()

    loop.core.runner.execute = recording
    seen = wrap_lane(loop.core)
    loop.start()
    try:
        streams = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
        loop.add(AddRequest("s0", [5, 6, 7], streams, listener)).result(30)
        time.sleep(0.3)  # the stream decodes before the long prompt arrives
        loop.add(AddRequest("long", long_prompt(12, 300), GREEDY, listener)).result(30)
        assert done.wait(120)
    finally:
        loop.stop()
    assert [request_id for request_id, _, _ in seen] == ["long"]  # the lane read it
    first_token = events.index(("out", "long"))
    first_forward = next(i for i, (kind, what) in enumerate(events) if kind == "forward" and "long" in what)
    assert first_token < first_forward


def test_a_prompt_waits_for_the_busy_lane_at_most_its_bound_then_the_steps_read_it(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_max_wait_ms=300)
    release, seen, tokens, step = held_lane(core)
    try:
        start_streams(core, params=SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        core.add_request(core.make_request("long", long_prompt(14, 100), GREEDY))
        step()  # the lane takes it and holds it
        core.add_request(core.make_request("queued", long_prompt(16, 100), GREEDY))
        step()  # queued in the lane behind it
        core.add_request(core.make_request("next", long_prompt(15, 100), GREEDY))
        arrived = time.monotonic()
        step()
        assert core.scheduler.requests["next"].num_computed_tokens == 0  # waiting for the lane
        while time.monotonic() - arrived < 0.3:
            time.sleep(0.01)
        step()
        assert core.scheduler.requests["next"].num_computed_tokens >= 100  # read in the steps
        assert core.lane.pending == ["long", "queued"]
        release.set()
        for request_id in ("s0", "s1"):
            core.abort_request(request_id)
        while core.has_unfinished_requests():
            step()
            time.sleep(0.001)
        assert len(tokens["long"]) == len(tokens["queued"]) == len(tokens["next"]) == GREEDY.max_tokens
        assert [request_id for request_id, _, _ in seen] == ["long", "queued"]
        core.check_integrity()
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    finally:
        release.set()
        core.close()


def test_a_prompt_waits_for_the_busy_lane_only_while_its_measured_backlog_fits_the_bound(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="first",
                 prefill_lane_max_wait_ms=2000)
    release, seen, tokens, step = held_lane(core)
    streams = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = {name: long_prompt(60 + index, 100) for index, name in enumerate(("long", "queued", "late", "next"))}
    try:
        tokens.update(start_streams(core, params=streams))
        assert core.lane.backlog_ms(time.monotonic()) is None  # nothing measured yet
        core.add_request(core.make_request("long", prompts["long"], GREEDY))
        step()  # the lane takes it and holds it
        assert core.lane.pending == ["long"]
        core.lane.ms_per_token = 0.5  # as if measured: 50 ms for what it holds, well within 2 s
        assert 0 <= core.lane.backlog_ms(time.monotonic()) <= 50
        core.add_request(core.make_request("queued", prompts["queued"], GREEDY))
        step()  # in time: queued in the lane behind it
        assert core.lane.pending == ["long", "queued"]
        core.lane.ms_per_token = 6.0  # 1.2 s for the 200 tokens it holds
        assert 1000 < core.lane.backlog_ms(time.monotonic()) <= 1200
        core.add_request(core.make_request("late", prompts["late"], GREEDY))
        step()  # the lane is full, and it would read "late" too within 2 s (1.8): it waits at the head
        assert core.scheduler.requests["late"].num_computed_tokens == 0
        core.add_request(core.make_request("next", prompts["next"], GREEDY))
        step()  # 200 tokens queued would take the lane to 2.4 s: the steps read the head now...
        assert core.scheduler.requests["late"].num_computed_tokens > 0
        assert core.scheduler.requests["next"].num_computed_tokens == 0  # ...and the next waits (1.8 s again)
        core.lane.ms_per_token = 15.0  # now 3 s for what it holds alone: past the bound
        assert 2000 < core.lane.backlog_ms(time.monotonic()) <= 3000
        step()  # waiting would cost it 2 s and then the steps: they read it now
        assert core.scheduler.requests["next"].num_computed_tokens > 0
        assert core.lane.pending == ["long", "queued"]
        done = threading.Semaphore(0)
        core.lane.on_done = done.release
        release.set()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
        step()  # the lane's results come back: its cost is measured on them again
        assert core.lane.pending == [] and core.counters.num_lane_prompts == 2
        assert core.lane.ms_per_token != 15.0
        drain(core, step)
        assert [request_id for request_id, _, _ in seen] == ["long", "queued"]
    finally:
        release.set()
        core.close()

    assert_plain_engines_tokens(tiny_llama_dir, streams, prompts, tokens)


def test_the_lane_measures_its_ms_per_token_on_its_own_threads_alone(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="first")
    release, _, tokens, step = held_lane(core)
    layers, seconds = [], []
    record_layers(core, layers, seconds=seconds)
    release.set()
    try:
        start_streams(core, params=SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))
        core.add_request(core.make_request("narrow", long_prompt(70, 150), GREEDY))
        deadline = time.monotonic() + 60
        while core.counters.num_lane_prompts == 0:  # the streams keep the engine thread stepping
            assert time.monotonic() < deadline, "the lane did not compute its prompt"
            step()
        measured = core.lane.ms_per_token  # its layers' time, within the prompt's whole time on the lane
        # every layer on the lane's thread (3 of the tiny model's, then the output), none helped
        assert core.counters.lane_layers_helped == 0 and [thread for _, _, thread, _ in layers] == ["prefill-lane"] * 3
        # the engine times each layer around the call this test times inside it, and the layers
        # within the prompt's whole time on the lane: bounds that hold however loaded the machine
        # (the time between layers, a wait or the scheduler's, counts in the second alone)
        assert sum(seconds) * 1000.0 / 150 <= measured <= core.counters.lane_busy_s * 1000.0 / 150

        release.clear()
        core.add_request(core.make_request("wide", long_prompt(71, 150), GREEDY))
        step()
        assert core.lane.pending == ["wide"]
        for request_id in ("s0", "s1", "narrow"):
            core.abort_request(request_id)
        step()  # nothing to step now: the engine thread takes the lane's prompt over
        assert core.lane.engine_holds
        release.set()
        drain(core, step)
        assert core.counters.num_lane_prompts == 2
        assert core.lane.ms_per_token == measured  # the engine thread computed every layer: not the lane's cost
    finally:
        release.set()
        core.close()


def test_the_overflow_policy_reads_a_lone_prompt_in_the_steps_and_gives_the_lane_what_overflows(tiny_llama_dir):
    # prompts of 100 tokens in steps of at most 48: a prompt read in the steps takes several
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="overflow",
                 max_num_batched_tokens=48)
    release, seen, tokens, step = held_lane(core)
    streams = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompts = {name: long_prompt(20 + index, 100) for index, name in enumerate(("alone", "second", "third", "fourth"))}
    try:
        tokens.update(start_streams(core, params=streams))
        core.add_request(core.make_request("alone", prompts["alone"], GREEDY))
        step()  # nothing else waits for prefill: the steps read it, in chunks
        assert core.lane.pending == [] and 0 < core.scheduler.requests["alone"].num_computed_tokens < 100
        core.add_request(core.make_request("second", prompts["second"], GREEDY))
        step()  # a prompt is being read in the steps: the next one overflows into the lane
        assert core.lane.pending == ["second"]
        core.add_request(core.make_request("third", prompts["third"], GREEDY))
        step()  # the lane is busy: queued behind it
        assert core.lane.pending == ["second", "third"]
        core.add_request(core.make_request("fourth", prompts["fourth"], GREEDY))
        step()  # the lane is full: it waits at the head of the queue (no wait bound here)
        assert core.scheduler.requests["fourth"].num_computed_tokens == 0
        done = threading.Semaphore(0)
        core.lane.on_done = done.release
        release.set()
        assert done.acquire(timeout=60) and done.acquire(timeout=60)  # the lane finished both
        step()  # the overflow drained: the lane is empty, "alone" is read, and "fourth" waits alone
        assert core.lane.pending == [] and core.scheduler.requests["fourth"].num_computed_tokens > 0
        drain(core, step)
        assert [request_id for request_id, _, _ in seen] == ["second", "third"]
    finally:
        release.set()
        core.close()

    assert_plain_engines_tokens(tiny_llama_dir, streams, prompts, tokens)


def test_the_overflow_policy_sends_the_lane_the_head_when_two_prompts_wait(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="overflow")
    try:
        scheduler = core.scheduler
        start_streams(core)
        core.add_request(core.make_request("first", long_prompt(30, 100), GREEDY))
        assert scheduler.take_for_lane() is None  # alone: the steps read it on every thread
        core.add_request(core.make_request("behind", long_prompt(31, 100), GREEDY))
        seq = scheduler.take_for_lane()  # another waits behind it: the head goes to the lane
        assert seq is not None and seq.request_id == "first"
        assert scheduler.take_for_lane() is None  # now alone again (nothing was submitted to the lane)
        for request_id in ("first", "behind", "s0", "s1"):
            core.abort_request(request_id)
        run(core, [])
        core.check_integrity()
        assert core.block_pool.num_free_blocks == core.block_pool.num_blocks
    finally:
        core.close()
    with pytest.raises(ValueError, match="prefill_lane_policy"):
        build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="sometimes")


class SetPace:
    """The streams' pace as a test sets it (the engine's own StreamPace is measured in
    tests/engine/test_step_budget.py and below)."""

    def __init__(self, ms: float | None) -> None:
        self.value = ms

    def observe(self, ended_at: float) -> None:
        pass

    def ms(self, now: float) -> float | None:
        return self.value


def test_the_pace_policy_gives_the_lane_a_prompt_only_while_the_streams_are_slower_than_its_bound(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="pace", prefill_lane_pace_ms=60.0)
    release, seen, tokens, step = held_lane(core)
    streams = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompts = {name: long_prompt(50 + index, 100) for index, name in enumerate(("slow", "fast", "unmeasured"))}
    pace = SetPace(75.0)
    try:
        tokens.update(start_streams(core, params=streams))
        core.scheduler.step_budget.pace = pace
        core.add_request(core.make_request("slow", prompts["slow"], GREEDY))
        step()  # 75 ms apart, over the bound: the lane takes it
        assert core.lane.pending == ["slow"]
        pace.value = 45.0
        core.add_request(core.make_request("fast", prompts["fast"], GREEDY))
        step()  # 45 ms apart, but the lane is busy: the steps have one thread; it waits for the lane to be done
        assert core.lane.pending == ["slow"] and core.scheduler.requests["fast"].num_computed_tokens == 0
        done = threading.Semaphore(0)
        core.lane.on_done = done.release
        release.set()
        assert done.acquire(timeout=60)
        step()  # the lane is done and the streams are fast: the steps read it, on every thread
        assert core.lane.pending == [] and core.scheduler.requests["fast"].num_computed_tokens > 0
        pace.value = None
        core.add_request(core.make_request("unmeasured", prompts["unmeasured"], GREEDY))
        step()  # no pace measured yet: the steps
        assert core.lane.pending == [] and core.scheduler.requests["unmeasured"].num_computed_tokens > 0
        drain(core, step)
        assert [request_id for request_id, _, _ in seen] == ["slow"]
    finally:
        release.set()
        core.close()

    assert_plain_engines_tokens(tiny_llama_dir, streams, prompts, tokens)
    with pytest.raises(ValueError, match="prefill_lane_pace_ms"):
        build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="pace", prefill_lane_pace_ms=0.0)


def test_the_engine_measures_its_streams_pace_from_its_decoding_steps(tiny_llama_dir):
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="pace")
    try:
        start_streams(core, params=SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
        began = time.monotonic()
        for _ in range(10):
            core.step()
        mean_ms = (time.monotonic() - began) * 1000.0 / 10
        measured = core.scheduler.step_budget.pace.ms(time.monotonic())
        # the intervals between the ten steps' ends: within the wall time of the loop (no host work between)
        assert measured is not None and 0 < measured <= mean_ms * 1.5
        # Stats reports the same pace (tandem:worker_stream_pace_ms), and 0 once the streams are gone
        assert worker_stats(core, "decode", "here").stream_pace_ms == pytest.approx(measured, rel=0.05)
        run(core, [])
        time.sleep(core.scheduler.step_budget.pace.window_s + 0.05)
        assert worker_stats(core, "decode", "here").stream_pace_ms == 0.0
    finally:
        core.close()


def test_the_engine_counts_its_steps_and_their_time_apart_for_decode_only_and_prompt_steps(tiny_llama_dir):
    """Stats' step counters (what `tandem bench compare` prints beside `bench engine`'s
    offline steps) against a record of every forward the runner executed."""
    core = build(tiny_llama_dir, None, max_model_len=512, max_num_batched_tokens=64)
    record: list[tuple[int, int, float]] = []  # (decodes, prompt tokens, seconds) per executed step
    execute = core.runner.execute

    def timed(scheduled):
        began = time.perf_counter()
        try:
            return execute(scheduled)
        finally:
            record.append((scheduled.num_decodes, scheduled.num_batched_tokens - scheduled.num_decodes,
                           time.perf_counter() - began))

    core.runner.execute = timed
    try:
        start_streams(core, params=SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        run(core, [("long", long_prompt(31, 150))])  # read in 64-token chunks beside the streams
    finally:
        core.close()
    decode_only = [r for r in record if r[1] == 0]
    with_prompt = [r for r in record if r[1] > 0]
    assert decode_only and len(with_prompt) >= 3  # the streams' prompts, then the long one's chunks
    stats = worker_stats(core, "decode", "here")
    assert (stats.num_decode_steps, stats.num_prompt_steps) == (len(decode_only), len(with_prompt))
    assert stats.decode_steps_seqs == sum(r[0] for r in decode_only)
    # the engine times the runner's execute (forward and sampling), which the wrapper timed inside it
    for counted_ms, steps in ((stats.decode_steps_ms, decode_only), (stats.prompt_steps_ms, with_prompt)):
        executed_ms = sum(r[2] for r in steps) * 1000
        assert executed_ms <= counted_ms <= executed_ms + 1.0 * len(steps)


def record_layers(core, layers: list[tuple[str, int, str, int]], holds: dict | None = None,
                  reached: threading.Event | None = None, seconds: list[float] | None = None):
    """Record each layer the lane's prompts compute: (which part: whole, first or second half,
    layer, thread, its torch threads), in the order they end. ``holds``: {(part, layer): event}
    (read at each layer): the thread that computed that layer sets ``reached`` and waits for
    the event before it goes on (still inside its turn). ``seconds``: each layer's own time,
    timed inside the engine's timing of it."""
    execute_layers = core.lane.runner.execute_layers

    def recorded(step):
        seq = step.seqs[0]
        part = "first" if seq.sampling is None else "second" if seq.start_pos > 0 else "whole"
        inner = execute_layers(step)

        def layer_by_layer():
            while True:
                started = time.perf_counter()
                try:
                    index = next(inner)
                except StopIteration as stop:
                    return stop.value
                if seconds is not None:
                    seconds.append(time.perf_counter() - started)
                layers.append((part, index, threading.current_thread().name, torch.get_num_threads()))
                if holds and (part, index) in holds:
                    if reached is not None:
                        reached.set()
                    assert holds[part, index].wait(60)
                yield index

        return layer_by_layer()

    core.lane.runner.execute_layers = recorded


def test_with_nothing_to_step_the_engine_thread_computes_the_lanes_layers_and_gives_them_back_to_step(
        lane_core, smollm_dir):
    """The lane's thread keeps its one torch thread: while the engine thread has nothing to step,
    it computes the lane's prompt itself on both of its threads, a layer per step() call, and
    the lane thread goes on once the engine steps again (a second OpenMP team of two threads
    would slow every engine step: engine/engine_loop.py)."""
    layers: list[tuple[str, int, str, int]] = []
    gate, reached = threading.Event(), threading.Event()
    record_layers(lane_core, layers, {("whole", 1): gate}, reached)  # the lane thread stops in layer 1
    try:
        short = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        tokens = start_streams(lane_core, params=short)
        prompt = long_prompt(40, 200)
        lane_core.add_request(lane_core.make_request("long", prompt, GREEDY))
        lane_core.step()
        assert reached.wait(30)  # in the lane, beside the streams
        while lane_core.scheduler.running:  # the streams end while the lane holds the prompt
            for output in lane_core.step():
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        helped = threading.Event()
        helper = threading.Thread(target=lambda: (lane_core.step(), helped.set()), name="engine-stand-in")
        helper.start()  # nothing to step: it waits for the lane's layer in flight, then computes the next
        assert not helped.wait(0.3) and lane_core.lane.engine_holds
        gate.set()
        assert helped.wait(30)
        helper.join(30)
        assert layers[2] == ("whole", 2, "engine-stand-in", 2)
        assert lane_core.lane_wants_help()  # the prompt has layers left, and the engine holds it
        lane_core.add_request(lane_core.make_request("late", [5, 6, 7], short))
        lane_core.step()  # a step to run: the lane thread gets the prompt back
        assert not lane_core.lane.engine_holds
        for request_id, new in run(lane_core, []).items():
            tokens.setdefault(request_id, []).extend(new)
    finally:
        gate.set()
    assert [index for _, index, _, _ in layers] == list(range(30))
    assert {(thread, threads) for _, _, thread, threads in layers if thread != "engine-stand-in"} <= {
        ("prefill-lane", 1), ("MainThread", 2)}
    assert any(thread == "prefill-lane" for _, _, thread, _ in layers[3:])  # given back after "late" came
    assert torch.get_num_threads() == 2

    plain = build(smollm_dir, None)
    try:
        reference = run(plain, [("long", prompt)])
    finally:
        plain.close()
    assert tokens["long"] == reference["long"]  # the same tokens, on one thread or two


def test_beside_streams_with_slack_the_engine_thread_reads_the_second_half_a_layer_behind_the_first(smollm_dir):
    """A prompt of SPLIT_MIN_TOKENS or more is read in halves: the lane thread reads the first;
    between its steps, while a step and a layer fit in --prefill-lane-help-ms, the engine
    thread reads layers of the second on its one thread, each only once the first half has
    that layer's KV; with a bound no step fits in, it does not. The tokens are those of an
    engine without a lane."""
    from engine.prefill_lane import SPLIT_MIN_TOKENS

    core = build(smollm_dir, LANE_MIN, prefill_lane_help_ms=1e6)  # any step and layer fit
    layers: list[tuple[str, int, str, int]] = []
    prompts = {"long": long_prompt(50, SPLIT_MIN_TOKENS + 40), "late": long_prompt(51, SPLIT_MIN_TOKENS + 10),
               "idle": long_prompt(52, SPLIT_MIN_TOKENS + 60)}
    streams = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    gate, reached = threading.Event(), threading.Event()
    holds = {("first", 3): gate}
    try:
        record_layers(core, layers, holds, reached)  # the first half stops after its layer 3
        tokens = start_streams(core, params=streams)
        for _ in range(3):  # the streams' pace is measured
            step_into(core, tokens)
        core.add_request(core.make_request("long", prompts["long"], GREEDY))
        deadline = time.monotonic() + 60
        while ("first", 3, "prefill-lane", 1) not in layers:
            assert time.monotonic() < deadline
            step_into(core, tokens)
        for _ in range(8):  # the engine thread catches up with the first half, and waits there
            step_into(core, tokens)
        assert [index for part, index, _, _ in layers if part == "second"] == [0, 1, 2]
        gate.set()
        while "long" not in tokens:
            step_into(core, tokens)
        assert core.counters.num_lane_prompts == 1
        assert core.lane.ms_per_token > 0  # measured on the layers its own thread computed
        by_engine = [(index, threads) for part, index, thread, threads in layers if thread == "MainThread"]
        assert by_engine and {threads for _, threads in by_engine} == {1}  # its own thread, the lane has the other
        assert core.counters.lane_layers_helped == len(by_engine)
        assert worker_stats(core, "decode", "here").num_lane_layers_helped == len(by_engine)  # in Stats
        assert {(part, thread) for part, _, thread, _ in layers} <= {
            ("first", "prefill-lane"), ("second", "prefill-lane"), ("second", "MainThread")}
        for position, (part, index, _, _) in enumerate(layers):
            if part == "second":  # the first half had computed that layer before
                assert ("first", index) in [(p, i) for p, i, _, _ in layers[:position]]
        assert [i for p, i, _, _ in layers if p == "first"] == [i for p, i, _, _ in layers if p == "second"] == list(
            range(30))

        for request_id in ("s0", "s1"):
            core.abort_request(request_id)
        for request_id, new in run(core, []).items():
            tokens.setdefault(request_id, []).extend(new)

        # the streams end while the lane reads the first half: with nothing to step, the engine
        # thread reads the second beside it on its one thread, and the rest on both once the
        # first half is done
        layers[:], idle = [], threading.Event()
        reached.clear()
        holds[("first", 0)] = idle
        start_streams(core, params=SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        core.add_request(core.make_request("idle", prompts["idle"], GREEDY))
        step_into(core, tokens)
        assert reached.wait(30)
        while core.scheduler.running:
            step_into(core, tokens)
        idle.set()
        while "idle" not in tokens:
            step_into(core, tokens)
        by_engine = [(index, threads) for part, index, thread, threads in layers if thread == "MainThread"]
        assert {threads for _, threads in by_engine} == {1, 2} and by_engine[-1] == (29, 2)
        assert all(part == "second" for part, _, thread, _ in layers if thread == "MainThread")
        for request_id, new in run(core, []).items():
            tokens.setdefault(request_id, []).extend(new)
        drain(core, core.step)
    finally:
        for event in holds.values():
            event.set()
        core.close()

    # a bound no step and layer fit in: the lane reads both halves alone
    tight = build(smollm_dir, LANE_MIN, prefill_lane_help_ms=1e-3)
    layers[:] = []
    try:
        record_layers(tight, layers)
        late = start_streams(tight, params=streams)
        for _ in range(3):
            step_into(tight, late)
        tight.add_request(tight.make_request("late", prompts["late"], GREEDY))
        while "late" not in late:
            step_into(tight, late)
        for request_id in ("s0", "s1"):
            tight.abort_request(request_id)
        for request_id, new in run(tight, []).items():
            late.setdefault(request_id, []).extend(new)
        assert tight.counters.lane_layers_helped == 0
        assert {thread for _, _, thread, _ in layers} == {"prefill-lane"} and len(layers) == 60
        drain(tight, tight.step)
    finally:
        tight.close()
    tokens["late"] = late["late"]
    plain = build(smollm_dir, None)
    try:
        reference = run(plain, list(prompts.items()))
    finally:
        plain.close()
    assert {name: tokens[name] for name in prompts} == reference


class SetTradeoff:
    """What a prompt token costs the streams in the lane and in the steps, as a test sets it
    (LaneTradeoff's arithmetic is tested in tests/engine/test_step_budget.py, the engine's
    measures of it below)."""

    def __init__(self) -> None:
        self.lane: float | None = None
        self.step_ms_per_token: float | None = None
        self.beside_at: float | None = None
        self.prompt_apart_at: float | None = None

    def observe(self, shape) -> None:
        pass

    def lane_ms(self, lane_ms_per_token: float | None) -> float | None:
        return self.lane


def add_and_check_where_it_went(core, step, tokens: dict[str, list[int]], name: str, prompt: list[int],
                                to_lane: bool) -> None:
    """Add ``name``, step once, check that the lane took it (or the steps read it) as
    ``to_lane`` says, then step until the lane is idle for the next case; the two streams of
    200 tokens are still decoding."""
    core.add_request(core.make_request(name, prompt, GREEDY))
    step()
    assert core.lane.pending == ([name] if to_lane else []), name
    assert (core.scheduler.requests[name].num_computed_tokens > 0) is not to_lane, name
    deadline = time.monotonic() + 60
    while core.lane.busy:
        assert time.monotonic() < deadline
        step()
    assert core.scheduler.running and all(len(tokens[s]) < 200 for s in ("s0", "s1"))


def policy_core(model_dir, policy: str, **kwargs):
    """An engine with the lane under ``policy`` (pace bound 60 ms), the prompts it computes
    recorded (``wrap_lane``): the core, that record, the tokens each request got, and a step that
    collects them. The tests below pair it with two streams of ``LONG_STREAMS`` decoding."""
    core = build(model_dir, LANE_MIN, max_model_len=512, prefill_lane_policy=policy, prefill_lane_pace_ms=60.0,
                 **kwargs)
    seen = wrap_lane(core)
    tokens: dict[str, list[int]] = {}
    return core, seen, tokens, functools.partial(step_into, core, tokens)


LONG_STREAMS = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


def test_the_cost_policy_gives_the_lane_a_prompt_only_when_it_costs_the_streams_less(tiny_llama_dir):
    core, seen, tokens, step = policy_core(tiny_llama_dir, "cost")
    streams = LONG_STREAMS
    pace, costs = SetPace(75.0), SetTradeoff()
    # (prompt, the streams' pace, ms per prompt token for the streams in the lane and in the steps,
    #  seconds since each was measured, whether the lane takes it)
    cases = [("unmeasured", 75.0, None, None, None, None, True),  # the pace alone decides
             ("dearer", 75.0, 0.5, 0.3, 1.0, 1.0, False),
             ("cheaper", 75.0, 0.2, 0.3, 1.0, 1.0, True),
             ("dearer-long-ago", 75.0, 0.5, 0.3, 31.0, 1.0, True),  # the lane tried again
             ("cheaper-steps-long-ago", 75.0, 0.2, 0.3, 1.0, 31.0, False),  # the steps tried again
             ("fast-streams", 45.0, 0.2, 0.3, 1.0, 1.0, False)]  # within the pace: the steps, as `pace`
    prompts = {case[0]: long_prompt(60 + index, 100) for index, case in enumerate(cases)}
    try:
        tokens.update(start_streams(core, params=streams))
        core.scheduler.step_budget.pace, core.scheduler.step_budget.tradeoff = pace, costs
        for name, pace_ms, lane_ms, steps_ms, lane_age, steps_age, to_lane in cases:
            now = time.monotonic()
            pace.value, costs.lane, costs.step_ms_per_token = pace_ms, lane_ms, steps_ms
            costs.beside_at = None if lane_age is None else now - lane_age
            costs.prompt_apart_at = None if steps_age is None else now - steps_age
            add_and_check_where_it_went(core, step, tokens, name, prompts[name], to_lane)
        drain(core, step)
    finally:
        core.close()
    assert [request_id for request_id, _, _ in seen] == [case[0] for case in cases if case[6]]
    assert_plain_engines_tokens(tiny_llama_dir, streams, prompts, tokens)


class FixedTradeoff(LaneTradeoff):
    """LaneTradeoff with the steps' costs a test sets (it learns nothing from the steps)."""

    step_ms_per_token: float | None = None
    step_ms_per_token_beside: float | None = None

    def observe(self, shape) -> None:
        pass


def test_a_ttft_ratio_gives_the_lane_a_prompt_only_when_it_answers_about_as_soon_as_the_steps(tiny_llama_dir):
    """``prefill_lane_ttft_ratio``: under ``pace``, with the streams behind, the lane takes a
    prompt only if, at its measured ms per token after its backlog, it gives the first token
    within the ratio times the steps' time (StepBudget.prompt_ms: the steps' costs, the prompt
    tokens running requests still lack counted ahead of it), and never while the steps read a
    prompt. Here the steps take 30 ms a step beside the decodes and 1 ms a prompt token: a lone
    100-token prompt 130 ms."""
    core, seen, tokens, step = policy_core(tiny_llama_dir, "pace", prefill_lane_ttft_ratio=1.2)
    streams = LONG_STREAMS
    pace, costs = SetPace(75.0), FixedTradeoff()
    costs.decode_ms_apart, costs.step_ms_per_token = 30.0, 1.0
    # (prompt, its length, the lane's ms per token (None: not measured), whether the lane takes it)
    cases = [("unmeasured", 100, None, True),
             ("slow-lane", 100, 3.0, False),  # 300 ms against 1.2 x 130
             ("fast-lane", 100, 1.5, True),  # 150 ms
             # from here on the steps read 16 prompt tokens a step: 19 steps and 300 tokens (870 ms) against 1500
             ("ahead", 300, 5.0, False),
             # 500 ms: more than 1.2 x 310 (7 steps, 100 tokens) alone, less behind 284 of ahead's (1325),
             # but the steps are reading ahead: the lane takes no prompt then (the two would each
             # read one on half the threads), and this one follows ahead in the steps
             ("behind-a-prompt", 100, 5.0, False)]
    prompts = {name: long_prompt(70 + index, length) for index, (name, length, _, _) in enumerate(cases)}
    try:
        tokens.update(start_streams(core, params=streams))
        budget = core.scheduler.step_budget
        budget.pace, budget.tradeoff = pace, costs
        for name, _, lane_ms_per_token, to_lane in cases:
            if name == "behind-a-prompt":
                ahead = core.scheduler.requests["ahead"]
                assert ahead.num_tokens - ahead.num_computed_tokens == 284
            core.lane.ms_per_token = lane_ms_per_token
            if name == "ahead":
                budget.prompt_tokens = lambda num_decodes, beside_lane=False: 16
            if name != "behind-a-prompt":
                add_and_check_where_it_went(core, step, tokens, name, prompts[name], to_lane)
                continue
            core.add_request(core.make_request(name, prompts[name], GREEDY))
            while ahead.num_tokens - ahead.num_computed_tokens > 1:  # it waits for ahead, out of the lane
                step()
                assert core.lane.pending == [] and core.scheduler.requests[name].num_computed_tokens == 0
            step()
            assert core.scheduler.requests[name].num_computed_tokens > 0
        drain(core, step)
    finally:
        core.close()
    assert [request_id for request_id, _, _ in seen] == [case[0] for case in cases if case[3]]
    assert_plain_engines_tokens(tiny_llama_dir, streams, prompts, tokens)
    with pytest.raises(ValueError, match="prefill_lane_ttft_ratio"):
        build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="pace", prefill_lane_ttft_ratio=0.0)


def test_the_engine_measures_what_a_prompt_costs_the_streams_beside_the_lane_and_apart_from_it(lane_core):
    """Each step's share of its time beside a prompt in the lane (``StepShape.lane_share``):
    none before the lane has a prompt, all of it while the lane holds one (a prompt held at
    its start counts as computing); the measures in Stats are LaneTradeoff's."""
    budget = lane_core.scheduler.step_budget
    shapes = []
    observe = budget.observe
    budget.observe = lambda shape: (shapes.append(shape), observe(shape))
    release = threading.Event()
    seen = wrap_lane(lane_core, lambda: release.wait(60))
    try:
        short = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        tokens = start_streams(lane_core, params=short)
        for _ in range(3):
            step_into(lane_core, tokens)  # the streams alone
        lane_core.add_request(lane_core.make_request("long", long_prompt(70, 200), GREEDY))
        step_into(lane_core, tokens)  # the lane takes it and holds it
        held = len(shapes)
        for _ in range(3):
            step_into(lane_core, tokens)  # the streams beside it
        beside = shapes[held:]
        release.set()
        drain(lane_core, functools.partial(step_into, lane_core, tokens))
    finally:
        release.set()
        budget.observe = observe
    assert [request_id for request_id, _, _ in seen] == ["long"]
    apart = [shape for shape in shapes[:held - 1] if shape.num_prompt_tokens == 0]
    assert len(apart) >= 3 and all(shape.lane_share == 0.0 for shape in apart)
    assert len(beside) == 3 and all(shape.num_prompt_tokens == 0 and shape.lane_share >= 0.9 for shape in beside)
    tradeoff = budget.tradeoff
    assert tradeoff.decode_ms_apart > 0 and tradeoff.slowdown > 0 and tradeoff.step_ms_per_token > 0
    stats = worker_stats(lane_core, "decode", "here")
    assert stats.lane_slowdown == pytest.approx(tradeoff.slowdown, rel=1e-6)
    assert stats.step_ms_per_prompt_token == pytest.approx(tradeoff.step_ms_per_token, rel=1e-6)
    assert stats.step_ms_per_prompt_token_beside == pytest.approx(tradeoff.step_ms_per_token_beside or 0.0, rel=1e-6)
    assert stats.lane_ms_per_token == pytest.approx(lane_core.lane.ms_per_token or 0.0, rel=1e-6)


def test_under_pace_the_lane_stays_out_of_a_queue_it_would_not_get_through_and_of_the_steps_prompt(tiny_llama_dir):
    """``pace``, the streams behind: the idle lane takes the head of the queue only if, at its
    measured ms per token, it would read everything waiting within ``prefill_lane_max_wait_ms``
    (else the steps read the queue on every thread, one prompt after the other), and never while
    the steps are reading a prompt of their own (the two would read one each, on half the
    threads each)."""
    core, seen, tokens, step = policy_core(tiny_llama_dir, "pace", prefill_lane_max_wait_ms=2000.0)
    streams = LONG_STREAMS
    names = ["q0", "q1", "q2", "lone", "chunked", "next"]
    prompts = {name: long_prompt(90 + index, 100) for index, name in enumerate(names)}
    pace = SetPace(75.0)
    try:
        tokens.update(start_streams(core, params=streams))
        budget = core.scheduler.step_budget
        budget.pace = pace
        core.lane.ms_per_token = 10.0  # three prompts of 100 tokens: 3 s of the lane's time, over the bound
        for name in ("q0", "q1", "q2"):
            core.add_request(core.make_request(name, prompts[name], GREEDY))
        step()
        assert core.lane.pending == [] and core.scheduler.requests["q0"].num_computed_tokens > 0
        while any(name not in tokens for name in ("q0", "q1", "q2")):
            step()
            assert core.lane.pending == []
        core.lane.ms_per_token = 1.0  # one prompt, 100 ms: the lane takes it
        core.add_request(core.make_request("lone", prompts["lone"], GREEDY))
        step()
        assert core.lane.pending == ["lone"]
        while core.lane.busy:
            step()
        # the steps read a prompt in chunks (the streams were fast when it came); the next waits for them
        pace.value = 45.0
        budget.prompt_tokens = lambda num_decodes, beside_lane=False: 16
        core.add_request(core.make_request("chunked", prompts["chunked"], GREEDY))
        step()
        pace.value = 75.0
        core.add_request(core.make_request("next", prompts["next"], GREEDY))
        chunked = core.scheduler.requests["chunked"]
        while chunked.num_tokens - chunked.num_computed_tokens > 1:
            assert core.lane.pending == [] and core.scheduler.requests["next"].num_computed_tokens == 0
            step()
        drain(core, step)
    finally:
        core.close()
    assert [request_id for request_id, _, _ in seen] == ["lone", "next"]
    assert all(len(tokens[name]) == GREEDY.max_tokens for name in names)


def test_a_prompt_the_busy_lane_would_not_reach_in_time_waits_for_it_only_if_it_is_done_first(tiny_llama_dir):
    """``pace``: the busy lane would not get to the head prompt within the bound. If the lane is
    done with what it holds before the steps, on every thread, would have read the prompt
    (StepBudget.prompt_ms), the prompt waits for it, then the steps read it on every thread;
    otherwise the steps read it now, beside the lane."""
    core = build(tiny_llama_dir, LANE_MIN, max_model_len=512, prefill_lane_policy="pace", prefill_lane_pace_ms=60.0)
    release, seen, tokens, step = held_lane(core)
    streams = LONG_STREAMS
    prompts = {name: long_prompt(110 + index, 100) for index, name in enumerate(("held", "waits"))}
    costs = FixedTradeoff()
    costs.decode_ms_apart, costs.step_ms_per_token = 30.0, 1.0  # the steps read 100 tokens in 130 ms
    backlog = [50.0]
    try:
        tokens.update(start_streams(core, params=streams))
        scheduler = core.scheduler
        scheduler.step_budget.pace, scheduler.step_budget.tradeoff = SetPace(75.0), costs
        core.add_request(core.make_request("held", prompts["held"], GREEDY))
        step()
        assert core.lane.pending == ["held"]
        scheduler._lane_in_time = lambda request: False
        core.lane.backlog_ms = lambda now: backlog[0]
        core.add_request(core.make_request("waits", prompts["waits"], GREEDY))
        step()  # the lane is done in 50 ms, the steps would take 130: it waits
        assert core.lane.pending == ["held"] and scheduler.requests["waits"].num_computed_tokens == 0
        backlog[0] = 500.0
        step()  # now the lane is 500 ms from done: the steps read it beside the lane
        assert core.lane.pending == ["held"] and scheduler.requests["waits"].num_computed_tokens > 0
        release.set()
        drain(core, step)
    finally:
        release.set()
        core.close()
    assert [request_id for request_id, _, _ in seen] == ["held"]
