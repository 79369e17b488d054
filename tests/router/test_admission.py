"""Admission at the router (router/admission.py, router/traffic.py) on its own: the bounded
queue by traffic class, displacement, shedding and deadlines, on an event loop without
workers."""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.request_queue import SchedulingPolicy
from router.admission import Admission
from router.errors import APIError
from router.traffic import TrafficClass, TrafficClasses, load_traffic_classes

CLASSES = TrafficClasses(SchedulingPolicy.PRIORITY, {
    "default": TrafficClass("default"),
    "interactive": TrafficClass("interactive", priority=0, ttft_ms=2000, tpot_ms=150),
    "batch": TrafficClass("batch", priority=10, ttft_ms=60000, sheddable=True),
})


def test_a_file_defines_classes_and_bad_files_say_what_is_wrong(tmp_path):
    path = tmp_path / "classes.yaml"
    path.write_text("interactive: {priority: 0, ttft_ms: 2000}\nbatch:\n  priority: 10\n  ttft_ms: 60000\n"
                    "  sheddable: true\n")
    classes = load_traffic_classes(path, "priority")
    assert classes.names == ["batch", "default", "interactive"]
    assert classes.classes["batch"] == TrafficClass("batch", 10, 60000, None, True)
    as_json = tmp_path / "classes.json"
    as_json.write_text(json.dumps({"default": {"priority": 3}}))
    assert load_traffic_classes(as_json, "priority").classes["default"].priority == 3
    for text, message in [("batch: {priority: 10}", "needs --scheduling-policy priority"),
                          ("batch: {sheddable: true}", "needs ttft_ms"),
                          ("batch: {weight: 2}", "unknown settings"),
                          ("batch: {ttft_ms: -5}", "positive number"),
                          ("'bad name!': {}", "A-Z a-z"),
                          ("- a\n- b", "mapping")]:
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_traffic_classes(path, "fcfs" if "scheduling" in message else "priority")


def test_a_request_resolves_its_class_and_priority():
    assert CLASSES.resolve(None, None).traffic_class.name == "default"
    assert CLASSES.resolve("batch", None).priority == 10
    assert CLASSES.resolve("batch", 2).priority == 2  # its own priority overrides the class's
    with pytest.raises(APIError) as error:
        CLASSES.resolve("gold", None)
    assert error.value.status == 400 and error.value.param == "traffic_class"
    fcfs = TrafficClasses()
    assert fcfs.resolve(None, 0).priority == 0
    with pytest.raises(APIError) as error:
        fcfs.resolve(None, 1)
    assert error.value.status == 400 and error.value.param == "priority"


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


async def one_running(traffic_class: str | None = None) -> tuple[Admission, object]:
    """Admission under priority with room for one sequence, which one request holds."""
    admission = Admission(max_queue=4, policy=SchedulingPolicy.PRIORITY, dispatch_limit=lambda: 1)
    running = admission.hold(1, CLASSES.resolve(traffic_class, None))
    await admission.wait_turn(running, 1)
    return admission, running


def test_the_queue_dispatches_by_class_when_the_workers_are_full():
    async def main():
        admission = Admission(max_queue=16, policy=SchedulingPolicy.PRIORITY, dispatch_limit=lambda: 1)
        first = admission.hold(1, CLASSES.resolve("default", None))
        await admission.wait_turn(first, 5)  # room for one: dispatched at once
        order = []

        async def wait(name, ticket):
            await admission.wait_turn(ticket, 5)
            order.append(name)

        tickets = {name: admission.hold(1, CLASSES.resolve(cls, None))
                   for name, cls in [("batch-1", "batch"), ("batch-2", "batch"), ("default", "default")]}
        tasks = [asyncio.create_task(wait(name, ticket)) for name, ticket in tickets.items()]
        await asyncio.sleep(0.05)
        assert order == [] and (admission.queued("batch"), admission.queued("default")) == (2, 1)
        for ticket in [first, tickets["default"], tickets["batch-1"]]:
            admission.release(ticket)  # each end makes room for the next in line
            await asyncio.sleep(0.01)
        await asyncio.gather(*tasks)
        assert order == ["default", "batch-1", "batch-2"]
        admission.release(tickets["batch-2"])
        assert admission.counts.held == 0 and admission.counts.dispatched == 0
    run(main())


def test_a_higher_class_never_waits_behind_a_lower_one_on_the_workers():
    """The workers are full of batch: an interactive request goes at once (the decode worker
    preempts batch for it); another batch request waits."""
    async def main():
        admission = Admission(max_queue=16, policy=SchedulingPolicy.PRIORITY, dispatch_limit=lambda: 2)
        batch = [admission.hold(1, CLASSES.resolve("batch", None)) for _ in range(2)]
        for ticket in batch:
            await admission.wait_turn(ticket, 1)
        urgent = admission.hold(1, CLASSES.resolve("interactive", None))
        await admission.wait_turn(urgent, 1)
        assert admission.counts.dispatched == 3
        late = admission.hold(1, CLASSES.resolve("batch", None))
        with pytest.raises(APIError):
            await admission.wait_turn(late, 0.05)
        for ticket in [*batch, urgent]:
            admission.release(ticket)
        assert admission.counts.held == 0 and admission.counts.dispatched == 0
    run(main())


def test_fcfs_dispatches_everything_at_once():
    async def main():
        admission = Admission(max_queue=4, policy=SchedulingPolicy.FCFS, dispatch_limit=lambda: 1)
        tickets = [admission.hold(1, TrafficClasses().resolve(None, None)) for _ in range(4)]
        for ticket in tickets:
            await admission.wait_turn(ticket, 1)
        assert admission.counts.dispatched == 4
        with pytest.raises(APIError) as error:
            admission.hold(1, TrafficClasses().resolve(None, None))
        assert error.value.status == 429
    run(main())


def test_a_full_queue_sheds_the_newest_of_a_lower_sheddable_class_never_a_higher_one():
    async def main():
        shed = []
        admission = Admission(max_queue=3, policy=SchedulingPolicy.PRIORITY, dispatch_limit=lambda: 1,
                              on_shed=lambda choice, why: shed.append((choice.traffic_class.name, why)))
        running = admission.hold(1, CLASSES.resolve("interactive", None))
        await admission.wait_turn(running, 5)
        old, new = (admission.hold(1, CLASSES.resolve("batch", None)) for _ in range(2))
        waits = [asyncio.create_task(admission.wait_turn(t, 5)) for t in (old, new)]
        await asyncio.sleep(0.01)
        urgent = admission.hold(1, CLASSES.resolve("interactive", None))  # full: the newest batch goes
        with pytest.raises(APIError) as error:
            await waits[1]
        assert error.value.status == 429 and shed == [("batch", "displaced")]
        with pytest.raises(APIError) as error:  # batch never displaces batch, nor interactive
            admission.hold(1, CLASSES.resolve("batch", None))
        assert error.value.status == 429 and len(shed) == 1
        for ticket in (running, urgent, old):
            admission.release(ticket)
        await asyncio.gather(waits[0], return_exceptions=True)
        assert admission.counts.held == 0
    run(main())


def test_waiting_past_the_deadline_is_a_504_that_releases_everything():
    async def main():
        admission, running = await one_running()
        late = admission.hold(1, CLASSES.resolve(None, None))
        with pytest.raises(APIError) as error:
            await admission.wait_turn(late, 0.05)
        assert error.value.status == 504
        assert admission.counts.held == 1 and admission.queued("default") == 0
        admission.release(running)
        admission.release(running)  # idempotent
        assert admission.counts.held == 0 and admission.counts.dispatched == 0
    run(main())


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        admission, running = await one_running()
        waiter = admission.hold(1, CLASSES.resolve(None, None))
        task = asyncio.create_task(admission.wait_turn(waiter, 5))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert admission.counts.held == 1
        admission.release(running)
        assert admission.counts.held == 0 and admission.counts.dispatched == 0
    run(main())
