"""Live `tandem serve` processes (real Ray, real workers, real HTTP) for the gateway tests."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

API_KEY = "test-api-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class LiveServer:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    grpc_target: str  # 127.0.0.1:GRPC_PORT (the public gRPC API)
    mode: str
    api_key: str | None
    log: list[str] = field(default_factory=list)  # stderr lines so far

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def metric(self, name: str, role: str) -> float:
        """A worker gauge from /metrics (summed over the role's workers)."""
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        pattern = re.compile(rf'^tandem:worker_{name}\{{address="[^"]+",role="{role}"\}} (\S+)$', re.M)
        values = [float(v) for v in pattern.findall(text)]
        assert values, f"no tandem:worker_{name} for {role} in /metrics"
        return sum(values)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout_s: float = 60) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def start_server(model_dir, mode: str, *extra: str, api_key: str | None = None, ready_timeout_s: float = 300,
                 wait_for: str = "ready: http", env: dict | None = None) -> LiveServer:
    """Start `tandem serve` and return once its log shows ``wait_for``."""
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "cluster.cli", "serve", "--model", str(model_dir), "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port), "--mode", mode, "--max-model-len", "1024",
               "--num-kv-blocks", "512", "--worker-threads", "1", "--served-model-name", "smollm2-135m-instruct",
               *extra]
    if api_key:
        command += ["--api-key", api_key]
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "RAY_ADDRESS"))}, **(env or {})}
    env.setdefault("TANDEM_CACHE_DIR", os.environ.get("TANDEM_CACHE_DIR", ""))
    if not env["TANDEM_CACHE_DIR"]:
        del env["TANDEM_CACHE_DIR"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                               cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    server = LiveServer(process, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", mode, api_key)
    threading.Thread(target=lambda: server.log.extend(process.stderr), daemon=True).start()
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {process.returncode}:\n" + "".join(server.log[-40:]))
        if any(wait_for in line for line in server.log):
            return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("tandem serve was not ready in time:\n" + "".join(server.log[-40:]))


@pytest.fixture(scope="session")
def disagg_server(smollm_dir):
    """Every prompt through a prefill worker (the path under test), however short."""
    server = start_server(smollm_dir, "disagg", "--local-prefill-max-tokens", "0")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def colocated_server(smollm_dir):
    """Also the server with an API key and a small admission limit."""
    server = start_server(smollm_dir, "colocated", "--max-queue", "3", api_key=API_KEY)
    yield server
    server.stop()
