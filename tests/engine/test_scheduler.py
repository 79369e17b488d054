"""The scheduler on its own: hand-built runner outputs, no model."""

from __future__ import annotations

import time

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_types import RunnerOutput, SampledToken

EOS = 2


def make_scheduler(num_blocks=32, block_size=4, max_num_seqs=8, budget=64, max_model_len=256, prefix=True):
    kv = KVCacheManager(BlockPool(num_blocks), block_size, namespace=b"test", enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), kv, max_model_len)


def make_request(rid, prompt_len=None, max_tokens=8, prompt=None, **params):
    """Distinct request ids get distinct prompts (no accidental prefix sharing)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    if prompt is None:
        base = 100 + 1000 * (sum(map(ord, rid)) % 97)
        prompt = list(range(base, base + prompt_len))
    return Request(rid, prompt, sp, seed=0, eos_token_ids=(EOS,), max_tokens=max_tokens)


def run_step(scheduler, token_for=lambda rid: 7):
    """Schedule, then answer with one token for every sequence that samples."""
    out = scheduler.schedule()
    sampled = {s.request_id: SampledToken(token_for(s.request_id), None) for s in out.seqs if s.sampling}
    updates = scheduler.update_from_output(out, RunnerOutput(sampled=sampled, prompt_logprobs={}))
    scheduler.kv.check_integrity()
    return out, updates


def test_streams_growing_side_by_side_keep_their_kv_in_runs_with_blocks_ahead():
    """Three streams that take a block every 4 tokens in turn: one block at a time, each one's
    table is scattered block by block; holding 3 blocks ahead, it is in runs of 4."""
    from engine.step_log import count_runs

    runs = {}
    for ahead in (0, 3):
        kv = KVCacheManager(BlockPool(64), 4, namespace=b"test", ahead_blocks=ahead)
        sched = Scheduler(SchedulerConfig(8, 64), kv, 256)
        for rid in "abc":
            sched.add_request(make_request(rid, 4, max_tokens=30))  # 33 tokens of KV: 9 blocks
        tables = {}
        while sched.has_unfinished():
            out, _ = run_step(sched)
            tables.update((seq.request_id, seq.block_ids) for seq in out.seqs)
        assert kv.pool.num_free_blocks == 64 and kv.num_blocks_ahead == 0
        assert all(len(table) == 9 for table in tables.values())
        runs[ahead] = [count_runs(table) for table in tables.values()]
    assert all(n >= 7 for n in runs[0]) and all(n <= 3 for n in runs[3]), runs


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    sched.add_request(make_request("a", 10, max_tokens=3))
    out, updates = run_step(sched)
    (seq,) = out.seqs
    assert seq.start_pos == 0 and len(seq.token_ids) == 10 and seq.sampling is not None
    assert len(seq.block_ids) == 3  # ceil(10 / 4)
    out, _ = run_step(sched)
    (seq,) = out.seqs
    assert seq.start_pos == 10 and seq.token_ids == [7] and seq.sampling.position == 11
    out, updates = run_step(sched)
    assert updates[0].finished and updates[0].request.status is RequestStatus.FINISHED_LENGTH
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 32


def test_continuous_batching_admits_and_retires_between_steps():
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=2))
    run_step(sched)
    sched.add_request(make_request("b", 6, max_tokens=4))
    out, _ = run_step(sched)  # a decodes, b prefills: one pass
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("a", 1), ("b", 6)]
    assert "a" not in sched.requests  # a finished at max_tokens=2 and was retired immediately
    out, _ = run_step(sched)
    assert [s.request_id for s in out.seqs] == ["b"]


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("long", 20))
    chunks = []
    for _ in range(3):
        out, _ = run_step(sched)
        chunks.append((out.seqs[0].start_pos, len(out.seqs[0].token_ids), out.seqs[0].sampling is not None))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 3))
    out, _ = run_step(sched)
    assert [s.request_id for s in out.seqs] == ["a", "b"] and len(sched.waiting) == 1


def test_eos_stop_ids_and_min_tokens():
    sched = make_scheduler()
    sched.add_request(make_request("eos", 3))
    sched.add_request(make_request("min", 3, min_tokens=2))
    sched.add_request(make_request("ign", 3, max_tokens=2, ignore_eos=True))
    sched.requests["ign"].eos_token_ids = ()
    _, updates = run_step(sched, token_for=lambda rid: EOS)
    status = {u.request.request_id: u.request.status for u in updates}
    assert status["eos"] is RequestStatus.FINISHED_STOPPED
    assert status["min"] is RequestStatus.RUNNING  # EOS before min_tokens does not stop
    assert status["ign"] is RequestStatus.RUNNING
    sched.add_request(make_request("stopid", 3, stop_token_ids=[99]))
    _, updates = run_step(sched, token_for=lambda rid: 99 if rid == "stopid" else EOS)
    done = {u.request.request_id: u.request for u in updates if u.finished}
    assert done["stopid"].stop_reason == 99
    assert done["min"].status is RequestStatus.FINISHED_STOPPED
    assert done["ign"].status is RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks_in_every_state():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", 9))
    sched.add_request(make_request("wait", 9))
    run_step(sched)
    assert sched.add_remote_kv_request(make_request("remote", 9), deadline_s=60) == 0
    for rid in ("run", "wait", "remote"):
        assert sched.finish_request(rid, RequestStatus.FINISHED_ABORTED).status is RequestStatus.FINISHED_ABORTED
    assert sched.finish_request("run", RequestStatus.FINISHED_ABORTED) is None  # idempotent
    sched.kv.check_integrity()
    assert sched.kv.pool.num_free_blocks == 32 and not sched.has_unfinished()


def test_preemption_newest_yields_and_resumes():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks, then grow
    sched = make_scheduler(num_blocks=6, block_size=4)
    sched.add_request(make_request("old", 8, max_tokens=12))
    sched.add_request(make_request("new", 8, max_tokens=12))
    preempted = []
    for _ in range(30):
        if not sched.has_unfinished():
            break
        out, _ = run_step(sched)
        preempted += out.preempted_ids
        assert "old" not in out.preempted_ids or "new" not in sched.running
    assert preempted and preempted[0] == "new"
    assert sched.num_preemptions == len(preempted)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 6


@pytest.mark.parametrize("prefix", [False, True])
def test_preempted_request_recomputes_its_tokens(prefix):
    sched = make_scheduler(num_blocks=6, block_size=4, prefix=prefix)
    old, new = make_request("old", 8, max_tokens=12), make_request("new", 8, max_tokens=12)
    sched.add_request(old)
    sched.add_request(new)
    while new.num_preemptions == 0:
        run_step(sched)
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    everything = new.prompt_token_ids + list(new.output_token_ids)
    while new.status is not RequestStatus.RUNNING:
        out, _ = run_step(sched)
    seq = next(s for s in out.seqs if s.request_id == "new")
    if not prefix:
        assert seq.start_pos == 0
    # with prefix caching it resumes after whatever full blocks survived in the cache
    assert seq.start_pos % 4 == 0 and seq.token_ids == everything[seq.start_pos :]
    while sched.has_unfinished():
        run_step(sched)


def test_remote_kv_joins_batch_and_expires():
    sched = make_scheduler()
    remote = make_request("r", 10)
    assert sched.add_remote_kv_request(remote, deadline_s=60) == 0
    assert remote.status is RequestStatus.WAITING_FOR_REMOTE_KV
    out = sched.schedule()
    assert out.seqs == []  # nothing to compute until the KV lands
    update = sched.finish_remote_kv("r", SampledToken(5, None))
    assert update.new_token_ids == [5] and not update.finished
    out, _ = run_step(sched)
    (seq,) = out.seqs
    assert seq.start_pos == 10 and seq.token_ids == [5]
    late = make_request("late", 10)
    assert sched.add_remote_kv_request(late, deadline_s=0.0) == 0
    time.sleep(0.01)
    assert sched.expired_remote_kv(time.monotonic()) == ["late"]  # reported; the engine picks the policy
    assert late.status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert sched.requeue_remote_kv("late") and not sched.requeue_remote_kv("late")
    out, _ = run_step(sched)  # the recompute policy: reservation released, prefilled locally
    assert late.status is RequestStatus.RUNNING and sched.expired_remote_kv(time.monotonic()) == []
    assert any(s.request_id == "late" and s.start_pos == 0 and len(s.token_ids) == 10 for s in out.seqs)


def test_remote_kv_without_blocks_changes_nothing():
    sched = make_scheduler(num_blocks=2, block_size=4)
    assert sched.add_remote_kv_request(make_request("big", 12), deadline_s=5) is None
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 2


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", 3))
    sched.finish_request("x", RequestStatus.FINISHED_ABORTED)


def drain(sched):
    while sched.has_unfinished():
        run_step(sched)


def test_prefix_cache_hit_skips_cached_blocks():
    sched = make_scheduler(block_size=4)
    shared = list(range(500, 510))  # 10 tokens: blocks [0:4] [4:8] full, [8:10] partial
    sched.add_request(make_request("a", prompt=shared, max_tokens=2))
    drain(sched)
    assert sched.kv.pool.num_cached_blocks >= 2
    b = make_request("b", prompt=shared[:8] + [7, 7, 7], max_tokens=2)
    sched.add_request(b)
    out, _ = run_step(sched)
    (seq,) = out.seqs
    assert seq.start_pos == 8 and seq.token_ids == [7, 7, 7] and b.num_cached_tokens == 8
    assert sched.kv.stats.num_hit_tokens == 8 and sched.kv.stats.num_queried_tokens == 10 + 11
    drain(sched)


def test_fully_cached_prompt_still_computes_one_token():
    sched = make_scheduler(block_size=4)
    prompt = list(range(600, 608))  # exactly two blocks
    sched.add_request(make_request("a", prompt=prompt, max_tokens=1))
    drain(sched)
    sched.add_request(make_request("b", prompt=prompt, max_tokens=1))
    out, _ = run_step(sched)
    assert out.seqs[0].start_pos == 4 and len(out.seqs[0].token_ids) == 4  # last block recomputed
    assert out.seqs[0].sampling is not None


def test_running_requests_share_blocks_and_salt_isolates():
    sched = make_scheduler(block_size=4)
    prompt = list(range(700, 713))
    a = make_request("a", prompt=prompt, max_tokens=6)
    sched.add_request(a)
    run_step(sched)  # a computed its prompt: 3 full blocks cached while a still runs
    b = make_request("b", prompt=prompt + [1], max_tokens=2)
    salted = make_request("salted", prompt=prompt + [1], max_tokens=2)
    salted.cache_salt = "tenant-2"
    sched.add_request(b)
    sched.add_request(salted)
    out, _ = run_step(sched)
    starts = {s.request_id: s.start_pos for s in out.seqs}
    assert starts["b"] == 12 and starts["salted"] == 0
    shared = sched.kv.block_table("a")[:3]
    assert sched.kv.block_table("b")[:3] == shared
    assert all(sched.kv.pool.ref_count(block) == 2 for block in shared)
    drain(sched)
    assert sched.kv.pool.num_free_blocks == 32


def test_prompt_logprobs_requests_do_not_skip_prefill():
    sched = make_scheduler(block_size=4)
    prompt = list(range(800, 810))
    sched.add_request(make_request("a", prompt=prompt, max_tokens=1))
    drain(sched)
    sched.add_request(make_request("b", prompt=prompt, max_tokens=1, prompt_logprobs=1))
    out = sched.schedule()
    assert out.seqs[0].start_pos == 0
    sched.finish_request("b", RequestStatus.FINISHED_ABORTED)


def test_lru_evicts_least_recently_freed_and_discards_content():
    sched = make_scheduler(num_blocks=6, block_size=4)
    discarded = []
    sched.kv.pool.add_discard_listener(discarded.extend)
    first, second = list(range(900, 909)), list(range(950, 959))
    sched.add_request(make_request("first", prompt=first, max_tokens=1))
    drain(sched)
    sched.add_request(make_request("second", prompt=second, max_tokens=1))
    drain(sched)
    assert sched.kv.pool.num_cached_blocks == 4
    # a request needing 4 fresh blocks: the 2 uncached go first, then the LRU cached ones
    sched.add_request(make_request("third", prompt=list(range(980, 995)), max_tokens=1))
    run_step(sched)
    assert sched.kv.pool.num_evictions == 2
    assert sched.kv.find_cached_prefix(make_request("x", prompt=first + [1])) == []  # first's were older
    assert len(sched.kv.find_cached_prefix(make_request("y", prompt=second + [1]))) == 2
    assert sched.kv.pool.num_evictions <= len(discarded)
    drain(sched)


def test_decodes_advance_while_a_long_prompt_is_read_in_chunks():
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("short", 2, max_tokens=8))
    run_step(sched)
    sched.add_request(make_request("long", 20, max_tokens=2))
    steps = []
    while sched.has_unfinished():
        out, _ = run_step(sched)
        steps.append({s.request_id: len(s.token_ids) for s in out.seqs})
    # every step of long's prefill also carries short's decode token
    assert steps[:4] == [{"short": 1, "long": 5}] * 4, steps
    assert steps[4] == {"short": 1, "long": 1}  # long decodes its second and last token


@pytest.mark.parametrize("second_len, second_step", [(6, {"a": 4}), (4, {"a": 4, "b": 4})])
def test_a_prompt_starts_beside_another_prompt_only_if_it_ends_there(second_len, second_step):
    # a (12 tokens) is read 8 + 4; b does not start in the 4 left beside a's last chunk unless it
    # ends there (whole): its head would hold up a's first token, and it would end a step later
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("a", 12, max_tokens=4))
    sched.add_request(make_request("b", second_len, max_tokens=4))
    steps = []
    for _ in range(3):
        out, _ = run_step(sched)
        steps.append({s.request_id: len(s.token_ids) for s in out.seqs})
    assert steps[0] == {"a": 8}
    assert steps[1] == second_step
    assert steps[2] == ({"a": 1, "b": 6} if second_len == 6 else {"a": 1, "b": 1})


def test_remote_kv_reuses_own_prefix_and_first_token_can_finish():
    sched = make_scheduler(block_size=4)
    prompt = list(range(300, 311))
    sched.add_request(make_request("local", prompt=prompt, max_tokens=1))
    drain(sched)
    remote = make_request("remote", prompt=prompt + [5], max_tokens=1)
    assert sched.add_remote_kv_request(remote, deadline_s=60) == 8  # two cached blocks already here
    update = sched.finish_remote_kv("remote", SampledToken(9, None))
    assert update.finished and remote.status is RequestStatus.FINISHED_LENGTH
    assert sched.kv.pool.num_free_blocks == 32
