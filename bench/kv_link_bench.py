"""`tandem bench kv-transfer --link`: the KV transports between two processes on loopback and,
in the same run, between this host and a second node behind a real interface (a network
namespace joined by a veth link, bench/netns.py), optionally shaped to a bandwidth
(``--link-rate``, ``tc tbf``).

The receiving side is a process of its own (``python -m bench.kv_link_bench HOST``), on the
host for loopback and inside the namespace for the link: a grpc.aio worker server with the
KV receiver (as a decode worker serves it) and, per transfer, a torch.distributed (gloo)
receiver bound to HOST. It takes commands as JSON lines on stdin and answers on stdout
(nothing from the network is parsed but the transports' own frames). Every chunk is
checksummed and the secret checked, as between workers; a transfer counts once every byte is
in the receiver's inbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from bench.kv_transfer_bench import TOKEN_SHAPE, CountingInbox, kv_of_size

SECRET = "bench-link-secret"


@dataclass(slots=True)
class LinkRow:
    path: str  # "loopback", "link", "link at 1gbit"
    size_mib: int
    grpc_mb_s: float
    gloo_mb_s: float


class ReceiverProcess:
    """The receiving side, as a child process (``wrap``: e.g. the namespace's ``ip netns exec``)."""

    def __init__(self, host: str, wrap=None, timeout_s: float = 120.0) -> None:
        command = [sys.executable, "-m", "bench.kv_link_bench", host]
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.timeout_s = timeout_s
        self.process = subprocess.Popen(wrap(command) if wrap else command, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env)
        self.grpc_address = self._read()["grpc"]

    def _read(self) -> dict:
        import select

        ready, _, _ = select.select([self.process.stdout], [], [], self.timeout_s)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the KV receiver process did not answer (exit {self.process.poll()})")
        return json.loads(line)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def _grpc_seconds(receiver: ReceiverProcess, kv: torch.Tensor) -> float:
    from kv_transfer.grpc_transport import GrpcKVSink

    before = receiver.ask(op="bytes")["bytes"]
    sink = GrpcKVSink(receiver.grpc_address, SECRET, timeout_s=600)
    start = time.perf_counter()
    sink.send_layer("bench", 0, 0, kv)
    reply = sink.finish()  # once the receiver has read the whole stream
    elapsed = time.perf_counter() - start
    got = receiver.ask(op="bytes")["bytes"] - before
    if reply is None or got != kv.numel() * 4:
        raise RuntimeError(f"gRPC transfer incomplete: {got} of {kv.numel() * 4} bytes ({sink.error})")
    return elapsed


def _gloo_seconds(receiver: ReceiverProcess, kv: torch.Tensor) -> float:
    from kv_transfer.torch_dist import TorchDistKVSink

    host, port = receiver.ask(op="gloo")["address"]
    sink = TorchDistKVSink((host, port), SECRET, timeout_s=600)
    time.sleep(0.3)  # let the pair connect: the transfer is timed, not the rendezvous
    start = time.perf_counter()
    sink.send_layer("bench", 0, 0, kv)
    error = sink.finish()
    done = receiver.ask(op="gloo_wait")  # once the receiver has every byte
    elapsed = time.perf_counter() - start
    if error or done["error"] or done["bytes"] != kv.numel() * 4:
        raise RuntimeError(f"gloo transfer incomplete: {done} ({error})")
    return elapsed


def measure(receiver: ReceiverProcess, path: str, sizes_mib: list[int], repeats: int) -> list[LinkRow]:
    rows = []
    for size in sizes_mib:
        kv = kv_of_size(size)
        mb = kv.numel() * 4 / 1e6
        grpc_s = min(_grpc_seconds(receiver, kv) for _ in range(repeats))
        gloo_s = min(_gloo_seconds(receiver, kv) for _ in range(repeats))
        rows.append(LinkRow(path, size, mb / grpc_s, mb / gloo_s))
    return rows


def link_throughput(sizes_mib: list[int], repeats: int = 3, rate: str | None = None) -> list[LinkRow]:
    """Loopback, then the link (and the link shaped to ``rate``), the same sizes, in one run."""
    from bench.netns import NamespaceLink

    rows = []
    loopback = ReceiverProcess("127.0.0.1")
    try:
        rows += measure(loopback, "loopback", sizes_mib, repeats)
    finally:
        loopback.close()
    with NamespaceLink() as link:
        remote = ReceiverProcess(link.ns_ip, wrap=link.command)
        try:
            rows += measure(remote, "link", sizes_mib, repeats)
            if rate:
                link.limit_rate(rate)
                rows += measure(remote, f"link at {rate}", sizes_mib, repeats)
        finally:
            remote.close()
    return rows


def render_link(rows: list[LinkRow]) -> str:
    lines = ["| path | KV size | tandem gRPC MB/s | gloo MB/s |", "|---|---|---|---|"]
    lines += [f"| {r.path} | {r.size_mib} MiB | {r.grpc_mb_s:.0f} | {r.gloo_mb_s:.0f} |" for r in rows]
    return "\n".join(lines)


def serve(host: str) -> int:
    """The receiving side: JSON lines in on stdin, out on stdout, until stdin closes."""
    from bench.kv_transfer_bench import serve_kv
    from kv_transfer.torch_dist import TorchDistKVReceiver

    counted = CountingInbox()
    server = serve_kv(counted, torch.float32, TOKEN_SHAPE, host, SECRET)

    def answer(**reply) -> None:
        print(json.dumps(reply), flush=True)

    answer(grpc=server.address)
    pair, pair_inbox = None, None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "bytes":
            answer(bytes=counted.num_bytes)
        elif command["op"] == "gloo":
            pair_inbox = CountingInbox()
            pair = TorchDistKVReceiver(pair_inbox, SECRET, torch.float32, TOKEN_SHAPE, host=host, timeout_s=600)
            answer(address=list(pair.address))
        elif command["op"] == "gloo_wait":
            if pair is None:
                answer(bytes=0, error="no gloo pair was opened")
                continue
            stats = pair.join(600)
            answer(bytes=pair_inbox.num_bytes, error=stats.error)
        else:
            answer(error=f"unknown command {command['op']!r}")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
