"""A `tandem serve` that started its own Ray and Redis (no --ray-address, no --redis-url) and is
SIGKILLed, as an OOM killer would: nothing it started is left running (Ray's head processes
and the workers share its fate; the private Redis dies with it by a parent-death signal)."""

from __future__ import annotations

import psutil

from tests.router.conftest import start_server
from tests.workers import wait_until


def running(pids: set[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(process.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            continue
    return alive


def test_a_sigkilled_router_leaves_no_process_behind(smollm_dir):
    server = start_server(smollm_dir, "disagg")
    tree = {process.pid for process in server.descendants()}
    names = " ".join(psutil.Process(pid).name() for pid in tree if psutil.pid_exists(pid))
    assert "redis-server" in names and "raylet" in names, names  # what it started: Ray, Redis, the workers
    server.process.kill()
    server.process.wait(30)
    try:
        wait_until(lambda: not running(tree), timeout_s=60, what="every process tandem serve started to be gone")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; still running: {running(tree)}") from None
    finally:
        for pid in tree:  # leave nothing for the next test, whatever happened
            try:
                psutil.Process(pid).kill()
            except psutil.NoSuchProcess:
                pass
