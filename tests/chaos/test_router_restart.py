"""Workers that outlive their router (issue 23): `tandem serve --ray-address` joins a Ray head of
its own (``ray start --head``, token auth, as on a real cluster), and its workers are detached.
A router SIGKILLed and started again attaches to the same worker processes and answers as
before; one that never comes back leaves workers that end themselves after --orphan-timeout;
a router that drains (SIGTERM) stops everything, as without --ray-address."""

from __future__ import annotations

import time

import httpx
import pytest

from bench.launch import RayHead
from tests.router.conftest import start_server
from tests.workers import wait_until

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    "]


@pytest.fixture(scope="module")
def ray_head():
    with RayHead({"prefill": 2, "decode": 2}, num_cpus=2) as head:
        yield head


def answers(server) -> list[str]:
    """Greedy completions of PROMPTS."""
    out = []
    for prompt in PROMPTS:
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=60, json={
            "model": "smollm2-135m-instruct", "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert reply.status_code == 200, reply.text
        out.append(reply.json()["choices"][0]["text"])
    return out


def serve(smollm_dir, head: RayHead, *extra: str):
    return start_server(smollm_dir, "disagg", "--ray-address", head.address, *extra, env=head.join_env)


def test_a_restarted_router_attaches_to_the_same_workers(smollm_dir, ray_head):
    first = serve(smollm_dir, ray_head)
    second = None
    try:
        before = answers(first)
        workers = ray_head.actor_pids()
        assert len(workers) == 2 and len(ray_head.actor_pids("IndexActor")) == 1
        first.process.kill()
        first.process.wait(30)
        time.sleep(2)
        assert ray_head.actor_pids() == workers  # detached: the router's death did not end them
        began = time.monotonic()
        second = serve(smollm_dir, ray_head)
        assert any("attached to 2 live workers" in line for line in second.log), "".join(second.log[-20:])
        assert not any("starting 1 prefill" in line for line in second.log)
        assert answers(second) == before
        print(f"restarted router: first answers {time.monotonic() - began:.1f} s after its start")  # stated in README
        assert ray_head.actor_pids() == workers  # the same processes served it: no restart, no model load
        second.stop()  # a drain stops everything, attached workers and the private Redis included
        wait_until(lambda: not ray_head.actor_pids() and not ray_head.actor_pids("IndexActor"), timeout_s=60,
                   what="a drained router to stop every worker and the index")
    finally:
        for server in (first, second):
            if server is not None:
                server.process.kill()


def test_workers_no_router_calls_end_themselves(smollm_dir, ray_head):
    server = serve(smollm_dir, ray_head, "--orphan-timeout", "6")
    try:
        assert answers(server)
        assert len(ray_head.actor_pids()) == 2
        server.process.kill()
        server.process.wait(30)
        killed = time.monotonic()
        wait_until(lambda: not ray_head.actor_pids(), timeout_s=90, what="orphaned workers to exit")
        assert time.monotonic() - killed >= 4  # they waited for a router first
        wait_until(lambda: not ray_head.actor_pids("IndexActor"), timeout_s=90,
                   what="the private Redis to end once no worker or router used it")
        time.sleep(3)
        assert not ray_head.actor_pids()  # ended for good: Ray did not restart them
    finally:
        server.process.kill()
