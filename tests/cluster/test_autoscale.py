"""Pool autoscaling's rules and its drain-then-stop order, on a real WorkerPool whose workers
are views (no Ray, no sockets); tests/router/test_serve_autoscale.py runs it for real."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from cluster.autoscale import PoolAutoscaler, PoolSize, ScaleDecider, ScaleRule, pool_size
from proto import worker_pb2 as pb
from router.policy import make_policy
from router.workers import WorkerPool


def test_pool_size_takes_n_or_min_max_and_rejects_the_rest():
    assert pool_size("3") == PoolSize(3, 3) and not pool_size("3").autoscaled
    assert pool_size("1:4") == PoolSize(1, 4) and pool_size("1:4").autoscaled
    assert str(pool_size("1:4")) == "1:4" and str(pool_size("2")) == "2"
    for bad in ("0", "3:2", "0:2", "a", "1:", ":3", "1:2:3", "-1:2", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError):
            pool_size(bad)


def test_the_serve_parser_reads_pool_bounds():
    from cluster.cli import build_parser

    args = build_parser().parse_args(["serve", "--prefill-workers", "1:3", "--decode-workers", "2"])
    assert args.prefill_workers == PoolSize(1, 3) and args.decode_workers == PoolSize(2, 2)
    assert build_parser().parse_args(["serve"]).prefill_workers == PoolSize(1, 1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill-workers", "4:2"])


def test_workers_ask_for_a_gpu_by_default_only_where_the_cluster_has_one():
    from cluster.cli import build_parser
    from cluster.serve import worker_gpus

    args = build_parser().parse_args(["serve"])
    assert (args.device, args.prefill_gpus, args.decode_gpus) == ("auto", None, None)
    assert build_parser().parse_args(["serve", "--decode-gpus", "0.5"]).decode_gpus == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill-gpus", "-1"])
    assert worker_gpus(None, "auto", cluster_gpus=8) == 1 and worker_gpus(None, "auto", cluster_gpus=0) == 0
    assert worker_gpus(None, "cpu", cluster_gpus=8) == 0 and worker_gpus(2, "cuda", cluster_gpus=8) == 2
    assert worker_gpus(0, "auto", cluster_gpus=8) == 0  # asked for none: the worker runs on the CPU
    with pytest.raises(ValueError, match="the Ray cluster has no GPU"):
        worker_gpus(None, "cuda", cluster_gpus=0)
    with pytest.raises(ValueError, match="asks Ray for 0 GPUs"):
        worker_gpus(0, "cuda", cluster_gpus=8)
    with pytest.raises(ValueError, match="would leave them idle"):
        worker_gpus(1, "cpu", cluster_gpus=8)


RULE = ScaleRule(queue_target=100, up_window_s=10, down_window_s=30)


def test_grows_only_after_the_queue_stayed_above_target_for_the_window():
    decider = ScaleDecider(PoolSize(1, 3), RULE)
    assert decider.observe(0, 1, 500, False) == 0
    assert decider.observe(9, 1, 500, False) == 0
    assert decider.observe(10, 1, 500, False) == +1
    decider.restart(10)
    assert decider.observe(11, 2, 500, False) == 0  # the window starts over after a change
    assert decider.observe(15, 2, 100, False) == 0  # 50 per worker: below target, window reset
    assert decider.observe(21, 2, 500, False) == 0
    assert decider.observe(30, 2, 500, False) == 0
    assert decider.observe(31, 2, 500, False) == +1
    at_max = ScaleDecider(PoolSize(1, 3), RULE)
    assert at_max.observe(0, 3, 10**6, False) == 0 and at_max.observe(100, 3, 10**6, False) == 0


def test_shrinks_only_when_idle_for_the_window_and_never_below_min():
    decider = ScaleDecider(PoolSize(1, 3), RULE)
    assert decider.observe(0, 2, 0, True) == 0
    assert decider.observe(20, 2, 0, False) == 0  # every worker busy: not idle
    assert decider.observe(21, 2, 0, True) == 0
    assert decider.observe(50, 2, 0, True) == 0
    assert decider.observe(51, 2, 0, True) == -1
    floor = ScaleDecider(PoolSize(1, 3), RULE)
    assert floor.observe(0, 1, 0, True) == 0 and floor.observe(1000, 1, 0, True) == 0
    busy = ScaleDecider(PoolSize(1, 3), RULE)  # 51 tokens would sit on one worker: over half the target (50)
    assert busy.observe(0, 2, 51, True) == 0 and busy.observe(1000, 2, 51, True) == 0
    quiet = ScaleDecider(PoolSize(1, 3), RULE)  # 100 over 2 of 3 workers: 50 each, at half the target
    assert quiet.observe(0, 3, 100, True) == 0 and quiet.observe(30, 3, 100, True) == -1


def test_a_pool_below_its_floor_grows_at_once_and_a_hold_delays_everything():
    decider = ScaleDecider(PoolSize(2, 3), RULE)
    assert decider.observe(0, 1, 0, True) == +1
    decider.restart(0, hold_s=10)
    assert decider.observe(5, 1, 0, True) == 0
    assert decider.observe(10, 1, 0, True) == +1


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stats(running: int = 0, waiting: int = 0, held: int = 0) -> pb.WorkerStats:
    return pb.WorkerStats(num_running=running, num_waiting=waiting, num_held_transfers=held)


def make_scaler(size: PoolSize, started: list, stopped: list, clock: Clock, fail: bool = False):
    pool = WorkerPool(["decode:1"], ["prefill:1"], "secret", make_policy("load"))
    for view in pool.decode + pool.prefill:
        view.healthy, view.stats = True, stats()

    def start_worker(role: str):
        if fail:
            raise RuntimeError("no node offers 'prefill'")
        address = f"{role}:{len(started) + 2}"
        started.append(address)
        return address

    scaler = PoolAutoscaler(pool, {"prefill": size, "decode": PoolSize(1, 1)},
                            {"prefill": RULE, "decode": RULE}, start_worker, stopped.append,
                            drain_timeout_s=60, clock=clock)
    return pool, scaler


def two_prefill_workers(clock: Clock, stopped: list, second_stats: pb.WorkerStats):
    """A pool at 1:2 holding two prefill workers, the second with ``second_stats``, after one
    look (the quiet window starts at 0; the caller moves the clock)."""
    pool, scaler = make_scaler(PoolSize(1, 2), [], stopped, clock)
    pool.add_workers("prefill", ["prefill:2"])
    second = pool.prefill[1]
    second.healthy, second.stats = True, second_stats
    scaler.step()
    return pool, scaler, second


async def settle(scaler) -> None:
    for state in scaler.pools.values():
        if state.changing is not None:
            await asyncio.wait_for(asyncio.shield(state.changing), 10)


def test_a_long_queue_adds_a_worker_that_joins_routing():
    async def main():
        clock, started, stopped = Clock(), [], []
        pool, scaler = make_scaler(PoolSize(1, 2), started, stopped, clock)
        pool.prefill[0].prompt_tokens_in_flight = 500
        scaler.step()
        clock.now = 10
        scaler.step()
        await settle(scaler)
        assert started == ["prefill:2"] and [w.address for w in pool.prefill] == ["prefill:1", "prefill:2"]
        clock.now = 100
        scaler.step()  # at MAX: nothing more, however long the queue
        await settle(scaler)
        assert started == ["prefill:2"]
        families = {f.name: f for f in scaler.collect()}
        events = {tuple(s.labels.values()): s.value for s in families["tandem:pool_scaling_events"].samples
                  if s.name.endswith("_total")}
        assert events[("prefill", "up")] == 1 and events[("decode", "up")] == 0

    asyncio.run(main())


def test_a_worker_that_fails_to_start_is_counted_and_retried_after_a_window():
    async def main():
        clock, started, stopped = Clock(), [], []
        pool, scaler = make_scaler(PoolSize(1, 2), started, stopped, clock, fail=True)
        pool.prefill[0].prompt_tokens_in_flight = 500
        scaler.step()
        clock.now = 10
        scaler.step()
        await settle(scaler)
        assert [w.address for w in pool.prefill] == ["prefill:1"]
        assert scaler.pools["prefill"].events["failed"] == 1
        clock.now = 15
        scaler.step()  # held for a window after the failure
        assert scaler.pools["prefill"].changing.done()
        clock.now = 20
        scaler.step()
        await settle(scaler)
        assert scaler.pools["prefill"].events["failed"] == 1  # the window started over at 20
        clock.now = 30
        scaler.step()
        await settle(scaler)
        assert scaler.pools["prefill"].events["failed"] == 2

    asyncio.run(main())


def test_shrinking_drains_first_then_stops_and_new_requests_avoid_the_draining_worker():
    async def main():
        clock, stopped = Clock(), []
        pool, scaler, newest = two_prefill_workers(clock, stopped, stats())
        clock.now = 30
        scaler.step()  # idle for the window: drain one, the newest (both are empty)
        await asyncio.sleep(0.01)
        assert newest.draining and not pool.prefill[0].draining
        # work that was already there when the drain began (the router's and the worker's own)
        newest.in_flight, newest.stats = 1, stats(running=1, held=1)
        draining = {tuple(s.labels.values()): s.value for f in scaler.collect() if f.name == "tandem:pool_workers"
                    for s in f.samples}
        assert draining[("prefill", "draining")] == 1 and draining[("prefill", "ready")] == 1
        for _ in range(20):  # every new request goes to the other worker
            assert pool.assign().prefill.address == "prefill:1"
        await asyncio.sleep(0.3)
        assert stopped == [] and newest in pool.prefill
        newest.in_flight = 0
        await asyncio.sleep(0.3)
        assert stopped == []  # the last Stats still shows KV being sent
        newest.stats = stats(held=1)
        await asyncio.sleep(0.3)
        assert stopped == []
        newest.stats = stats()  # a poll after the last request: empty
        await settle(scaler)
        assert stopped == ["prefill:2"] and [w.address for w in pool.prefill] == ["prefill:1"]
        assert scaler.pools["prefill"].events["down"] == 1
        clock.now = 1000
        scaler.step()  # at MIN: stays
        await settle(scaler)
        assert stopped == ["prefill:2"]

    asyncio.run(main())


def test_a_drain_that_outlives_its_deadline_stops_the_worker_anyway():
    async def main():
        clock, stopped = Clock(), []
        pool, scaler, _busy = two_prefill_workers(clock, stopped, stats(running=1))
        clock.now = 30
        scaler.step()
        await asyncio.sleep(0.01)
        assert pool.prefill[0].draining  # the empty one, not the busy newest one
        pool.prefill[0].stats = stats(running=1)
        await asyncio.sleep(0.2)
        assert stopped == []
        clock.now = 100  # past the drain deadline
        await settle(scaler)
        assert [w.address for w in pool.prefill] == ["prefill:2"] and stopped == ["prefill:1"]

    asyncio.run(main())
