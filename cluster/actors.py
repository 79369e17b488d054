"""Worker pools on Ray: placement, restarts and discovery (never the data path).

Each worker is a Ray actor that builds a PrefillWorker or DecodeWorker and serves it on its
own gRPC port. Actors ask for a custom resource named after their role (``prefill`` /
``decode``) and a fraction of a CPU, so one small machine hosts several; each pins its torch
threads (``EngineArgs.num_threads``). Ray restarts a dead actor (its constructor runs again
and binds a new port when the port is 0); ``WorkerHandle.refresh`` finds the new address.
A worker that is not ready within its deadline is a startup error, never a hang.

Under ``--ray-address`` the actors are detached and named (cluster/detached.py): they outlive
the router that started them, a restarted router attaches to them, and one that no router has
called for ``Placement.orphan_timeout_s`` drains and ends itself (for good: Ray does not
restart an actor killed with ``no_restart``).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, replace

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

from cluster.ray_processes import runs_ray_worker
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from proto import worker_pb2 as pb
from proto.rpc import Role

ROLES = tuple(Role)  # what launch_worker accepts, and the custom resources the actors ask for


class WorkerStartupError(RuntimeError):
    """A worker did not become ready before its deadline, or failed while starting."""


def _exit_soon(delay_s: float = 1.0) -> None:
    """End this process once its failed calls have had ``delay_s`` to answer their errors."""

    def exit_now() -> None:
        time.sleep(delay_s)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=exit_now, name="exit-on-engine-death", daemon=True).start()


class WorkerActor:
    """The Ray actor around one worker. Ray pickles only what its own control plane carries
    (the config at construction, small replies); requests and KV go over the worker's gRPC."""

    def __init__(self, role: Role, config: PrefillWorkerConfig | DecodeWorkerConfig, nice: int = 0,
                 orphan_timeout_s: float | None = None) -> None:
        self.role = Role(role)
        if nice > 0:  # below decode workers and the router where they share CPUs (lowering needs no privilege)
            os.nice(nice)
        if not config.server.host:  # serve on this node's address, wherever Ray placed us
            config = replace(config, server=replace(config.server, host=ray.util.get_node_ip_address()))
        self.worker = PrefillWorker(config) if self.role == Role.PREFILL else DecodeWorker(config)
        self.worker.runtime.exit_on_engine_death = _exit_soon  # then Ray restarts this actor
        self.address = self.worker.start()
        if orphan_timeout_s:
            threading.Thread(target=self._end_when_orphaned, args=(orphan_timeout_s,), name="orphan-watch",
                             daemon=True).start()

    def ready(self) -> str:
        self.worker.runtime.server.touch()  # a router attaching: not an orphan
        return self.address

    def pid(self) -> int:
        return os.getpid()

    def process(self) -> tuple[int, str]:
        """This actor's process id and its Ray node's id (``worker_processes``)."""
        return os.getpid(), ray.get_runtime_context().get_node_id()

    def _end_when_orphaned(self, timeout_s: float, drain_s: float = 30.0) -> None:
        """Once no router has called for ``timeout_s`` (its Stats polls come twice a second):
        finish what runs (``drain_s`` at most), stop, and end this actor for good."""
        server = self.worker.runtime.server
        while server.idle_s() < timeout_s:
            time.sleep(min(1.0, timeout_s / 4))
        logging.getLogger(__name__).warning("%s worker %s: no router called for %.0f s; draining and exiting",
                                            self.role, self.address, timeout_s)
        server.set_serving(False)
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            stats = self.worker.stats()
            if not (stats.num_running or stats.num_waiting or stats.num_waiting_for_remote_kv or stats.num_in_lane):
                break
            time.sleep(0.2)
        self.worker.stop()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    def stats(self) -> bytes:
        """A serialized WorkerStats."""
        return self.worker.stats().SerializeToString()

    def stop(self) -> None:
        self.worker.stop()


@dataclass
class WorkerHandle:
    role: Role
    actor: ray.actor.ActorHandle
    address: str  # host:port of its gRPC server

    def stats(self, timeout_s: float = 30.0) -> pb.WorkerStats:
        return pb.WorkerStats.FromString(ray.get(self.actor.stats.remote(), timeout=timeout_s))

    def refresh(self, timeout_s: float = 120.0) -> str:
        """After a restart: wait for the actor to be ready again and take its new address."""
        self.address = _wait_ready(self.role, self.actor, timeout_s)
        return self.address


def worker_processes(handles: list[WorkerHandle], timeout_s: float = 2.0) -> list[int]:
    """The process ids of the actors behind ``handles`` that run on this node, asked of all at
    once within ``timeout_s`` (one that does not answer in time is left out), for ``reap``."""
    if not handles:
        return []
    node = ray.get_runtime_context().get_node_id()
    refs = [handle.actor.process.remote() for handle in handles]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    pids = []
    for ref in ready:
        try:
            pid, where = ray.get(ref, timeout=0)
        except Exception:  # the actor died or restarted meanwhile: nothing of it to reap
            continue
        if where == node:
            pids.append(pid)
    return pids


def reap(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """Wait, ``timeout_s`` at most, until each of ``pids`` (worker actors' processes on this
    node, from ``worker_processes``) has ended after its actor was killed, then SIGKILL those
    still running a Ray worker; the ids killed. Ray marks a killed actor dead without checking
    that its process ended (ray-project/ray#52322), and such a process, left behind by a
    stopped ``tandem serve``, kept computing beside later benchmarks."""
    deadline = time.monotonic() + timeout_s
    alive = [pid for pid in pids if runs_ray_worker(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if runs_ray_worker(pid)]
    killed = []
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def init_ray(attempts: int = 3, **kwargs) -> None:
    """``ray.init(**kwargs)``, tried again after a failed start: on a loaded machine the raylet
    occasionally misses Ray's fixed 30 s registration window, and a second try succeeds."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(**kwargs)
            return
        except Exception:  # Ray raises a bare Exception for a node that timed out during startup
            ray.shutdown()
            if attempt == attempts:
                raise
            time.sleep(2.0)


@dataclass(frozen=True, slots=True)
class Placement:
    num_cpus: float = 0.5  # Ray's CPU accounting only; threads are pinned by EngineArgs.num_threads
    num_gpus: float = 0.0  # Ray sets CUDA_VISIBLE_DEVICES to what it grants (none: no GPU visible)
    max_restarts: int = -1  # Ray restarts a dead worker this often (-1: always, as Kubernetes does a pod)
    ready_timeout_s: float = 180.0
    nice: int = 0  # Unix niceness of the worker's process (0: unchanged)
    detached: bool = False  # outlives the driver (the router) that starts it; then it needs a name
    orphan_timeout_s: float | None = None  # a detached worker no router called for this long ends (None: never)


def _forwarded_env() -> dict[str, str]:
    """Variables the workers read that a joined Ray cluster's nodes would not have: the
    OpenTelemetry exporter's (headers, certificates, timeouts)."""
    return {key: value for key, value in os.environ.items() if key.startswith("OTEL_")}


def launch_worker(role: Role | str, config, placement: Placement = Placement(), name: str | None = None) -> WorkerHandle:
    """Start one worker actor on a node offering the ``role`` resource and wait until it
    serves. Raises WorkerStartupError (and kills the actor) if it is not ready in time."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {[str(r) for r in ROLES]}, got {role!r}")
    role = Role(role)
    env = _forwarded_env()
    actor = ray.remote(WorkerActor).options(
        num_cpus=placement.num_cpus, num_gpus=placement.num_gpus, resources={role: 1},
        max_restarts=placement.max_restarts, max_task_retries=0, name=name,
        lifetime="detached" if placement.detached else None, runtime_env={"env_vars": env} if env else None,
    ).remote(role, config, placement.nice, placement.orphan_timeout_s)
    try:
        address = _wait_ready(role, actor, placement.ready_timeout_s)
    except WorkerStartupError:
        ray.kill(actor, no_restart=True)
        raise
    return WorkerHandle(role, actor, address)


def attach_worker(role: Role, actor, timeout_s: float) -> WorkerHandle:
    """A handle on a live worker actor found by name (cluster/detached.py); raises
    WorkerStartupError if it does not answer within ``timeout_s``."""
    return WorkerHandle(Role(role), actor, _wait_ready(role, actor, timeout_s))


def _wait_ready(role: str, actor, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(actor.ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
        except ActorUnavailableError:  # restarting: ask again until the deadline
            if time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        except GetTimeoutError:
            break
        except RayActorError as exc:
            raise WorkerStartupError(f"the {role} worker failed to start: {exc}") from exc
    raise WorkerStartupError(
        f"the {role} worker was not ready within {timeout_s:.0f} s (is a node offering the "
        f"'{role}' resource up, with enough memory for the model?)")
