"""The priority scheduling policy (engine/request_queue.py, engine/scheduler.py): hand-built
runner outputs, no model. Lower priority values run first; a request never preempts one of
its own class or a higher one."""

from __future__ import annotations

import random

import pytest

from engine.config import SchedulerConfig
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_queue import FCFSQueue, PriorityQueue, SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.scheduler_types import RunnerOutput, SampledToken


def make_scheduler(policy="priority", num_blocks=32, block_size=4, max_num_seqs=8, budget=64):
    kv = KVCacheManager(BlockPool(num_blocks), block_size, namespace=b"test")
    return Scheduler(SchedulerConfig(max_num_seqs, budget, policy=SchedulingPolicy(policy)), kv, 256)


def make_request(rid, prompt_len, priority=0, arrival=0.0, max_tokens=8):
    base = 100 + 1000 * (sum(map(ord, rid)) % 97)
    request = Request(rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens,
                      temperature=0.0), seed=0, eos_token_ids=(), max_tokens=max_tokens, priority=priority)
    request.arrival_time = arrival
    return request


def step(scheduler):
    out = scheduler.schedule()
    sampled = {s.request_id: SampledToken(7, None) for s in out.seqs if s.sampling}
    scheduler.update_from_output(out, RunnerOutput(sampled=sampled, prompt_logprobs={}))
    scheduler.kv.check_integrity()
    return out


def test_queues_order_by_priority_then_arrival_and_fcfs_by_arrival():
    requests = [make_request(f"r{i}", 4, priority=p, arrival=t)
                for i, (p, t) in enumerate([(5, 1.0), (0, 3.0), (5, 0.5), (-1, 9.0), (0, 2.0)])]
    queue = PriorityQueue()
    for request in requests:
        queue.add(request)
    assert [r.request_id for r in queue] == ["r3", "r4", "r1", "r2", "r0"]
    assert queue.pop().request_id == "r3" and len(queue) == 4
    queue.remove(requests[1])
    assert [r.request_id for r in queue] == ["r4", "r2", "r0"]
    fcfs = FCFSQueue()
    for request in requests:
        fcfs.add(request)
    fcfs.add_back(requests[3])  # went back after running: first again
    assert [r.request_id for r in fcfs][:2] == ["r3", "r0"]


def test_waiting_requests_are_admitted_by_class_not_arrival():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("batch", 4, priority=10, arrival=1.0))
    sched.add_request(make_request("interactive", 4, priority=0, arrival=2.0))
    out = step(sched)
    assert [s.request_id for s in out.seqs] == ["interactive"]


def test_under_fcfs_arrival_order_wins():
    sched = make_scheduler("fcfs", max_num_seqs=1)
    sched.add_request(make_request("first", 4, arrival=1.0))
    sched.add_request(make_request("second", 4, arrival=2.0))
    assert [s.request_id for s in step(sched).seqs] == ["first"]


def test_a_higher_class_takes_a_lower_ones_slot_and_the_lower_one_resumes_later():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("batch", 4, priority=10, arrival=1.0, max_tokens=3))
    step(sched)
    step(sched)  # batch is decoding
    sched.add_request(make_request("interactive", 4, priority=0, arrival=2.0, max_tokens=2))
    out = step(sched)
    assert [s.request_id for s in out.seqs] == ["interactive"] and out.preempted_ids == ["batch"]
    assert sched.requests["batch"].status is RequestStatus.PREEMPTED
    step(sched)  # interactive finishes (2 tokens)
    assert "interactive" not in sched.requests
    out = step(sched)
    assert [s.request_id for s in out.seqs] == ["batch"]  # recomputes prompt + its first token
    for _ in range(20):
        step(sched)
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 32


def test_an_equal_class_never_takes_a_running_ones_slot():
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("old", 4, priority=3, arrival=1.0))
    step(sched)
    sched.add_request(make_request("new", 4, priority=3, arrival=2.0))
    out = step(sched)
    assert [s.request_id for s in out.seqs] == ["old"] and not out.preempted_ids


def test_prompt_chunks_share_the_budget_by_class():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("batch", 20, priority=10, arrival=1.0))
    step(sched)  # batch's first chunk (8 tokens)
    sched.add_request(make_request("interactive", 12, priority=0, arrival=2.0))
    out = step(sched)  # admitted before the running batch prompt's next chunk, which gets no room
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("interactive", 8)]
    out = step(sched)
    assert [(s.request_id, len(s.token_ids)) for s in out.seqs] == [("interactive", 4), ("batch", 4)]


def test_block_pressure_preempts_the_lowest_class_then_the_newest():
    sched = make_scheduler(num_blocks=8, budget=64)
    for rid, priority, arrival in [("hi", 0, 1.0), ("lo-old", 5, 2.0), ("lo-new", 5, 3.0)]:
        sched.add_request(make_request(rid, 7, priority=priority, arrival=arrival, max_tokens=8))
    preempted = []
    for _ in range(200):  # each needs 4 of the 8 blocks by its end: the three cannot all run
        out = step(sched)
        preempted += out.preempted_ids
        if not sched.has_unfinished():
            break
    assert not sched.has_unfinished() and sched.kv.pool.num_free_blocks == 8
    assert preempted and "hi" not in preempted
    assert preempted[0] == "lo-new"


@pytest.mark.parametrize("seed", range(20))
def test_random_traffic_a_lower_class_never_preempts_a_higher_one(seed):
    """Any arrivals, any sizes, a tight pool: whenever a request is preempted, every running
    request at that moment has a class at least as high, and whatever preempted it was of a
    class at least as high as the victim's; everything finishes and no block leaks."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=24, max_num_seqs=4, budget=16)
    pending = [make_request(f"r{i}", rng.randint(1, 20), priority=rng.choice([0, 1, 5]),
                            arrival=float(i), max_tokens=rng.randint(1, 12)) for i in range(30)]
    finished = set()
    for _ in range(2000):
        if pending and rng.random() < 0.4:
            sched.add_request(pending.pop(0))
        running_before = {r.request_id: r.priority for r in sched.running}
        waiting_before = {r.request_id: r.priority for r in sched.waiting}
        out = sched.schedule()
        for victim in out.preempted_ids:
            victim_class = running_before[victim]
            # what took its place: a running one that needed blocks, or a waiting one admitted now
            gainers = [running_before.get(s.request_id, waiting_before.get(s.request_id)) for s in out.seqs]
            assert gainers and min(gainers) <= victim_class
        sampled = {s.request_id: SampledToken(7, None) for s in out.seqs if s.sampling}
        for update in sched.update_from_output(out, RunnerOutput(sampled=sampled, prompt_logprobs={})):
            if update.finished:
                finished.add(update.request.request_id)
        sched.kv.check_integrity()
        if not pending and not sched.has_unfinished():
            break
    assert len(finished) == 30 and sched.kv.pool.num_free_blocks == 24


def test_remote_kv_admission_takes_blocks_from_a_lower_class_only():
    sched = make_scheduler(num_blocks=4)
    sched.add_request(make_request("batch", 12, priority=10, arrival=1.0, max_tokens=4))
    step(sched)  # batch holds 3 blocks (12 tokens) + grows
    equal = make_request("same-class", 8, priority=10, arrival=2.0)
    assert sched.add_remote_kv_request(equal, 5.0) is None and "batch" in [r.request_id for r in sched.running]
    urgent = make_request("urgent", 8, priority=0, arrival=3.0)
    assert sched.add_remote_kv_request(urgent, 5.0) == 0
    assert sched.requests["batch"].status is RequestStatus.PREEMPTED
    sched.kv.check_integrity()
