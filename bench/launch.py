"""Start `tandem serve` as a child process for a benchmark, and stop it (and everything it
started) afterwards."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
import time

# Ports for servers started later: between Ray's worker ports (10002-19999 by default) and the
# kernel's ephemeral range (32768 and up on Linux), so that nothing a `tandem serve` starts
# before it binds its own (Ray, its workers, their outgoing connections) can take the port first.
_PORTS = range(20000, 32768)


def free_port() -> int:
    """A loopback port that is free now and that no ephemeral allocation will hand out."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_PORTS)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {_PORTS.start}-{_PORTS.stop - 1}")


class _Launched:
    """A child process that is ready when ``_ready()`` says so; ``with`` gives ``base_url``."""

    name: str  # for errors
    command: list[str]
    env: dict | None
    base_url: str
    ready_timeout_s: float

    def __init__(self) -> None:
        self.log: list[str] = []  # stderr lines so far
        self.process: subprocess.Popen | None = None

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> str:
        """Start it and wait until ready; on exit or timeout, a RuntimeError with its log. It may be
        started again after ``stop`` (the same command and ports, a log of its own)."""
        name = self.name
        self.log = []  # a restart's ready line is its own, not the last start's
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=self.env)
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}:\n" + "".join(self.log[-40:]))
            if self._ready():
                return self.base_url
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} was not ready in time:\n" + "".join(self.log[-40:]))

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class LaunchedServe(_Launched):
    """``with LaunchedServe(["--mode", "disagg", ...]) as base_url: ...`` (base_url ends in /v1).

    ``env``: the child's whole environment (default: this one, less the listen flags);
    ``wait_for``: the log line that means started (default: the ready line)."""

    def __init__(self, serve_args: list[str], ready_timeout_s: float = 600.0, wait_for: str = "ready: http",
                 env: dict | None = None) -> None:
        super().__init__()
        self.port, self.grpc_port = free_port(), free_port()
        self.command = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                        "--grpc-port", str(self.grpc_port), *serve_args]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.ready_timeout_s = ready_timeout_s
        self.wait_for = wait_for
        self.env = env if env is not None else {
            k: v for k, v in os.environ.items() if k not in ("TANDEM_PORT", "TANDEM_GRPC_PORT", "TANDEM_HOST")}

    name = "tandem serve"

    def again(self) -> LaunchedServe:
        """The same command (ports included) and environment, not started: a restart."""
        import copy

        twin = copy.copy(self)
        twin.log, twin.process = [], None
        return twin

    def _ready(self) -> bool:
        return any(self.wait_for in line for line in self.log)


class LaunchedCommand(_Launched):
    """Any server as a child process, ready when ``health_url`` answers 200."""

    def __init__(self, command: list[str], health_url: str, base_url: str, ready_timeout_s: float = 600.0,
                 env: dict | None = None) -> None:
        super().__init__()
        self.name = os.path.basename(command[0])
        self.command, self.health_url, self.base_url = command, health_url, base_url
        self.ready_timeout_s = ready_timeout_s
        self.env = env

    def _ready(self) -> bool:
        import httpx

        try:
            return httpx.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False


class RayHead:
    """A Ray cluster of its own (``ray start --head``, token auth) for a `tandem serve
    --ray-address` to join, as on a real cluster, so that its workers can outlive it.
    ``stop`` kills exactly this head's processes (``ray stop`` would stop every Ray on the
    machine). ``node_ip``: the address the head serves on and its node is known by (another
    node's processes must reach it there: bench/netns.py's link address)."""

    def __init__(self, resources: dict[str, float], num_cpus: int | None = None, node_ip: str = "127.0.0.1",
                 wrap=None) -> None:
        import secrets
        import tempfile

        self.resources, self.num_cpus = resources, num_cpus or os.cpu_count()
        self.node_ip = node_ip
        self.wrap = wrap or (lambda command: command)  # how its `ray start` runs (RayNode: in a namespace)
        self.port = free_port()
        self.temp_dir = tempfile.mkdtemp(prefix="tandem-ray-")
        # what a process joining it needs: the token, and worker processes at niceness 0 (Ray's
        # default is 15, below the router)
        self.join_env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_worker_niceness": "0"}
        self.env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **self.join_env}

    @property
    def address(self) -> str:
        return f"{self.node_ip}:{self.port}"

    def _start_command(self) -> list[str]:
        return ["--head", "--port", str(self.port), "--include-dashboard", "false",
                "--ray-client-server-port", str(free_port()), "--dashboard-agent-listen-port", str(free_port())]

    def start(self, timeout_s: float = 120.0) -> str:
        import json

        ray = os.path.join(os.path.dirname(sys.executable), "ray")
        command = [ray, "start", *self._start_command(), "--node-ip-address", self.node_ip,
                   "--num-cpus", str(self.num_cpus), "--resources", json.dumps(self.resources),
                   "--disable-usage-stats", "--temp-dir", self.temp_dir]
        done = subprocess.run(self.wrap(command), env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start exited with {done.returncode}:\n{done.stderr[-4000:]}")
        return self.address

    def _owns(self, argv: list[str]) -> bool:
        """A process of this head's: it names the head's temp dir, or (Ray's client server, which
        does not, and outlives the head otherwise) the head's GCS port in its ``--address``."""
        return any(self.temp_dir in part or (part.startswith("--address=") and part.endswith(f":{self.port}"))
                   for part in argv)

    def processes(self) -> list:
        """This node's processes and all their children."""
        import psutil

        found: dict[int, psutil.Process] = {}
        for process in psutil.process_iter(["cmdline"]):
            if self._owns(process.info["cmdline"] or ()):
                found[process.pid] = process
                try:
                    found.update({child.pid: child for child in process.children(recursive=True)})
                except psutil.NoSuchProcess:
                    continue
        return list(found.values())

    def actor_pids(self, actor: str = "WorkerActor") -> set[int]:
        """The pids of this head's live actors of one class (Ray titles them ``ray::Class``)."""
        from cluster.ray_processes import ray_worker_pids

        return set(ray_worker_pids(actor, among=(process.pid for process in self.processes())))

    def stop(self) -> None:
        import shutil

        import psutil

        for process in self.processes():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                continue
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> RayHead:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RayNode(RayHead):
    """A worker node joining ``head`` (``ray start --address``, the head's token), offering
    ``resources`` (the ``prefill`` / ``decode`` custom resources place workers on it, as the
    Helm chart's worker pods do). ``wrap``: how its command runs (bench/netns.py's
    ``NamespaceLink.command``: on the far side of a link, with ``node_ip`` its address there)."""

    def __init__(self, head: RayHead, resources: dict[str, float], num_cpus: int, node_ip: str,
                 wrap=None) -> None:
        super().__init__(resources, num_cpus, node_ip, wrap)
        self.head = head
        self.port = head.port
        self.join_env, self.env = head.join_env, head.env

    @property
    def address(self) -> str:
        return self.head.address

    def _start_command(self) -> list[str]:
        return ["--address", self.head.address]

    def _owns(self, argv: list[str]) -> bool:
        return any(self.temp_dir in part for part in argv)

    def raylet_alive(self) -> bool:
        import psutil

        for process in self.processes():
            try:
                if os.path.basename((process.cmdline() or [""])[0]) == "raylet":
                    return True
            except psutil.NoSuchProcess:
                continue
        return False

    def restart(self, timeout_s: float = 60.0) -> str:
        """Start the node again, as Kubernetes restarts a pod whose raylet ended: after its
        raylet exits (a raylet the head declared dead exits once it hears so), or after
        ``timeout_s``, when it is killed. Says which."""
        deadline = time.monotonic() + timeout_s
        while self.raylet_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        how = "its raylet was killed" if self.raylet_alive() else "its raylet had exited"
        self.stop()
        self.start()
        return how
