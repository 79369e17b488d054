"""Worker processes that outlive their actor's kill (ray-project/ray#52322) are ended by
``tandem serve``'s stop (cluster/actors.py ``worker_processes`` and ``reap``)."""

from __future__ import annotations

import subprocess

import pytest

from cluster.actors import WorkerActor, WorkerHandle, reap, worker_processes
from proto.rpc import Role


def titled(title: str, seconds: float) -> subprocess.Popen:
    """A process whose command line starts with ``title`` (as a Ray worker's does), sleeping."""
    return subprocess.Popen(["bash", "-c", f'exec -a "{title}" sleep {seconds}'])


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
