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
        """Start it and wait until ready; on exit or timeout, a RuntimeError with its log."""
        name = self.name
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
