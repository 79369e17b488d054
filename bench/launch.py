"""Start `tandem serve` as a child process for a benchmark, and stop it (and everything it
started) afterwards."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LaunchedServe:
    """``with LaunchedServe(["--mode", "disagg", ...]) as base_url: ...`` (base_url ends in /v1).

    ``env``: the child's whole environment (default: this one, less the listen flags);
    ``wait_for``: the log line that means started (default: the ready line)."""

    def __init__(self, serve_args: list[str], ready_timeout_s: float = 600.0, wait_for: str = "ready: http",
                 env: dict | None = None) -> None:
        self.port, self.grpc_port = free_port(), free_port()
        self.command = [sys.executable, "-m", "cluster.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                        "--grpc-port", str(self.grpc_port), *serve_args]
        self.ready_timeout_s = ready_timeout_s
        self.wait_for = wait_for
        self.env = env if env is not None else {
            k: v for k, v in os.environ.items() if k not in ("TANDEM_PORT", "TANDEM_GRPC_PORT", "TANDEM_HOST")}
        self.log: list[str] = []  # stderr lines so far
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        """Start it and wait for ``wait_for``; on exit or timeout, a RuntimeError with its log."""
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=self.env)
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {self.process.returncode}:\n" + "".join(self.log[-40:]))
            if any(self.wait_for in line for line in self.log):
                return f"http://127.0.0.1:{self.port}/v1"
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("tandem serve was not ready in time:\n" + "".join(self.log[-40:]))

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


class LaunchedCommand:
    """Any server as a child process: ready when ``health_url`` answers 200 (``with`` gives
    ``base_url``); stopped with SIGTERM, then SIGKILL."""

    def __init__(self, command: list[str], health_url: str, base_url: str, ready_timeout_s: float = 600.0,
                 env: dict | None = None) -> None:
        self.command, self.health_url, self.base_url = command, health_url, base_url
        self.ready_timeout_s = ready_timeout_s
        self.env = env
        self.log: list[str] = []
        self.process: subprocess.Popen | None = None

    def start(self) -> str:
        import httpx

        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=self.env)
        threading.Thread(target=lambda: self.log.extend(self.process.stderr), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command[0]} exited with {self.process.returncode}:\n"
                                   + "".join(self.log[-40:]))
            try:
                if httpx.get(self.health_url, timeout=2).status_code == 200:
                    return self.base_url
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"{self.command[0]} was not ready in time:\n" + "".join(self.log[-40:]))

    stop = LaunchedServe.stop
    __enter__ = LaunchedServe.__enter__
    __exit__ = LaunchedServe.__exit__
