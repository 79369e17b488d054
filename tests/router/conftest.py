"""Live `tandem serve` processes (real Ray, real workers, real HTTP) for the gateway tests."""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest

from bench.launch import LaunchedServe
from tests.otlp import HttpOTLPReceiver
from tests.workers import wait_until

API_KEY = "test-api-key"
# A request seeded with this fails inside the engine of the servers below (tests/faults): the
# one fault no validation can catch, which must end that request only, with a 500.
FAULT_SEED = 4_242_424_242
FAULTS_DIR = Path(__file__).resolve().parent.parent / "faults"


def fault_env() -> dict:
    path = os.pathsep.join([str(FAULTS_DIR)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
    return {"PYTHONPATH": path, "TANDEM_TEST_FAULT_SEED": str(FAULT_SEED)}


@dataclass
class LiveServer:
    launched: LaunchedServe
    mode: str
    api_key: str | None

    @property
    def process(self) -> subprocess.Popen:
        return self.launched.process

    @property
    def log(self) -> list[str]:  # stderr lines so far
        return self.launched.log

    @property
    def base_url(self) -> str:  # http://127.0.0.1:PORT
        return f"http://127.0.0.1:{self.launched.port}"

    @property
    def grpc_target(self) -> str:  # 127.0.0.1:GRPC_PORT (the public gRPC API)
        return f"127.0.0.1:{self.launched.grpc_port}"

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
        self.launched.stop(timeout_s)


def assert_cut_short(server: LiveServer, decoded_before: float, how: str) -> None:
    """A 900-token request that the client left (``how``) ended on both workers soon after, far
    from its end, with every KV block free.

    /metrics holds each worker's last Stats (polled every 0.5 s), so a request that ends within
    one poll leaves the decode worker's snapshot from before it, idle and free: the wait takes a
    snapshot only once it counts the request's tokens. All workers are polled together, so the
    prefill worker's snapshots after it are from after its prompt too."""
    def idle_and_free(role: str) -> bool:
        return (server.metric("num_free_kv_blocks", role) == server.metric("num_kv_blocks", role)
                and server.metric("num_running", role) == 0)

    wait_until(lambda: server.metric("num_generation_tokens", "decode") > decoded_before and idle_and_free("decode"),
               what="the decode worker idle and free after the request's tokens")
    wait_until(lambda: idle_and_free("prefill"), what="the prefill worker idle and free")
    time.sleep(1)  # let a request that was not cut short run on, so the check below can fail
    decoded = server.metric("num_generation_tokens", "decode") - decoded_before
    assert 0 < decoded < 300, f"the request ran on after {how} ({decoded} tokens)"


def start_server(model_dir, mode: str, *extra: str, api_key: str | None = None, ready_timeout_s: float = 300,
                 wait_for: str = "ready: http", env: dict | None = None) -> LiveServer:
    """Start `tandem serve` (float32, small pools) and return once its log shows ``wait_for``.
    The child gets no TANDEM_* variable of ours but the cache directory, plus ``env``. Mode
    ``auto`` passes no ``--mode`` (the default); ``LiveServer.mode`` is then what it chose."""
    args = ["--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024",
            "--num-kv-blocks", "512", "--worker-threads", "1", "--served-model-name", "smollm2-135m-instruct", *extra]
    if mode != "auto":
        args += ["--mode", mode]
    if api_key:
        args += ["--api-key", api_key]
    child_env = {k: v for k, v in os.environ.items()
                 if not k.startswith(("TANDEM_", "RAY_ADDRESS")) or k == "TANDEM_CACHE_DIR"}
    launched = LaunchedServe(args, ready_timeout_s, wait_for, {**child_env, **(env or {})})
    launched.start()
    if mode == "auto":
        chosen = next(line for line in launched.log if "] mode: " in line)
        mode = chosen.split("] mode: ", 1)[1].split()[0]
    return LiveServer(launched, mode, api_key)


@pytest.fixture(scope="session")
def otlp_receiver():
    """Where disagg_server exports its traces (OTLP http/protobuf)."""
    receiver = HttpOTLPReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def disagg_server(smollm_dir, otlp_receiver):
    """Every prompt through a prefill worker (the path under test), however short; traced."""
    server = start_server(smollm_dir, "disagg", "--local-prefill-max-tokens", "0",
                          "--otlp-endpoint", otlp_receiver.url,
                          env={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", **fault_env()})
    yield server
    server.stop()


@pytest.fixture(scope="session")
def colocated_server(smollm_dir):
    """Also the server with an API key and a small admission limit; started without --mode,
    as `make serve` is: one node's shared cores, so auto must pick colocated."""
    server = start_server(smollm_dir, "auto", "--max-queue", "3", api_key=API_KEY, env=fault_env())
    yield server
    server.stop()
