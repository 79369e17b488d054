"""Worker processes that outlive their actor's kill (ray-project/ray#52322) are ended by
``tandem serve``'s stop (cluster/actors.py ``worker_processes`` and ``reap``), which tells a Ray
worker by its title (cluster/ray_processes.py)."""

from __future__ import annotations

import subprocess

import pytest

from cluster.actors import WorkerActor, WorkerHandle, reap, worker_processes
from cluster.ray_processes import ray_worker_pids
from proto.rpc import Role
from tests.workers import wait_until


def titled(title: str, seconds: float) -> subprocess.Popen:
    """A process whose command line starts with ``title`` (as a Ray worker's does), sleeping;
    returned once it does (bash has replaced itself), unless it ended already."""
    process = subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep {seconds}'])

    def titled_or_ended() -> bool:
        try:
            with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
                return cmdline.read().startswith(title.encode()) or process.poll() is not None  # (reaps it)
        except OSError:
            return True

    wait_until(titled_or_ended, timeout_s=10, what=f"the process to take the title {title}")
    return process


def test_reap_kills_a_ray_worker_left_running_and_leaves_every_other_process_alone():
    stray, other, ending = titled("ray::WorkerActor", 600), titled("sleep", 600), titled("ray::WorkerActor", 0.2)
    try:
        killed = reap([stray.pid, other.pid, ending.pid], timeout_s=1.0)
        assert killed == [stray.pid]
        assert stray.wait(timeout=10) == -9
        assert other.poll() is None  # not a Ray worker: a reused id is never killed
        assert ending.wait(timeout=10) == 0  # it ended within the wait by itself
        assert reap([stray.pid], timeout_s=0.1) == []  # gone
    finally:
        for process in (stray, other, ending):
            process.kill()
            process.wait()


def test_ray_workers_are_told_by_their_title_and_class_and_an_ended_one_is_not():
    worker, index, other = titled("ray::WorkerActor.step", 600), titled("ray::IndexActor", 600), titled("sleep", 600)
    ended = subprocess.Popen(["bash", "-c", 'exec -a "ray::WorkerActor" true'])  # never polled: left a zombie
    try:
        wait_until(lambda: open(f"/proc/{ended.pid}/stat").read().split(") ")[1].startswith("Z"), timeout_s=10,
                   what="the short process to end")  # not waited for: a zombie keeps its pid, not its command line
        everyone = ray_worker_pids()
        assert worker.pid in everyone and index.pid in everyone
        assert other.pid not in everyone and ended.pid not in everyone
        assert ray_worker_pids("WorkerActor", among=[worker.pid, index.pid, other.pid]) == [worker.pid]
        assert ray_worker_pids("IndexActor", among=[worker.pid, index.pid, ended.pid]) == [index.pid]
    finally:
        for process in (worker, index, other, ended):
            process.kill()
            process.wait()


@pytest.fixture
def probe(ray_cluster):
    """An actor with WorkerActor's own ``process`` (a whole worker is not needed for it)."""
    actor = ray_cluster.remote(num_cpus=0)(type("Probe", (), {"process": WorkerActor.process})).remote()
    pid, node = ray_cluster.get(actor.process.remote(), timeout=120)  # started (as a worker is before its stop)
    assert pid > 0 and node == ray_cluster.get_runtime_context().get_node_id()
    yield actor
    ray_cluster.kill(actor, no_restart=True)


def test_a_killed_workers_process_is_found_on_this_node_and_ended(ray_cluster, probe):
    handle = WorkerHandle(Role.DECODE, probe, "unused:0")
    pids = worker_processes([handle])
    assert len(pids) == 1 and reap(pids, timeout_s=0.1) == pids  # alive (not killed): reaped as a stray
    with pytest.raises(ray_cluster.exceptions.RayActorError):
        ray_cluster.get(probe.process.remote(), timeout=30)
    assert worker_processes([handle]) == []  # a dead actor answers nothing


def test_a_worker_that_ends_when_killed_needs_no_signal(ray_cluster, probe):
    pids = worker_processes([WorkerHandle(Role.DECODE, probe, "unused:0")])
    assert len(pids) == 1
    ray_cluster.kill(probe, no_restart=True)
    assert reap(pids, timeout_s=30) == []  # it ended by itself within the wait (else reap kills it)
