"""The second host itself (bench/netns.py): reached over its link by address, cut off by a
partition and reached again, and gone without a trace (namespace, link, processes) after use."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from bench.netns import NamespaceLink
from tests.workers import wait_until

PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("connected")
except OSError as exc:
    print(type(exc).__name__)
"""


def reach(link: NamespaceLink, host: str, port: int) -> str:
    done = subprocess.run(link.command([sys.executable, "-c", PROBE, host, str(port)]), capture_output=True,
                          text=True, timeout=30)
    return done.stdout.strip()


def test_the_link_carries_partitions_and_leaves_nothing_behind(namespaces):
    with NamespaceLink() as link:
        server = socket.create_server((link.host_ip, 0))
        port = server.getsockname()[1]
        accepting = threading.Thread(target=lambda: [server.accept() for _ in range(100)], daemon=True)
        accepting.start()
        assert reach(link, link.host_ip, port) == "connected"
        assert reach(link, "127.0.0.1", port) == "ConnectionRefusedError"  # its own loopback, not the host's
        link.set_link(False)
        assert reach(link, link.host_ip, port) in ("TimeoutError", "OSError")  # dropped, not refused
        link.set_link(True)
        # reached again (within seconds: the neighbour entry that failed during the cut is retried)
        wait_until(lambda: reach(link, link.host_ip, port) == "connected", timeout_s=15, what="the healed link")
        sleeper = subprocess.Popen(link.command(["sleep", "300"]))
        wait_until(lambda: sleeper.pid in link.pids(), timeout_s=10, what="the namespace's process")
        name, interface = link.name, link.host_if
        server.close()
    assert sleeper.wait(10) != 0  # killed with the namespace
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert subprocess.run(["ip", "link", "show", interface], capture_output=True).returncode != 0


def test_kv_crosses_the_link_checksummed_beside_loopback(namespaces):
    """`tandem bench kv-transfer --link`'s measurement, small: both transports carry every byte
    of a 4 MiB KV tensor to a receiver process on loopback and to one on the far side of the
    link (and the link shaped to 100 Mbit/s is slower than unshaped)."""
    from bench.kv_link_bench import link_throughput, render_link

    rows = link_throughput([4], repeats=1, rate="100mbit")
    print(render_link(rows))
    assert [row.path for row in rows] == ["loopback", "link", "link at 100mbit"]
    assert all(row.grpc_mb_s > 0 and row.gloo_mb_s > 0 for row in rows)
    shaped = rows[2]  # 100 Mbit/s is 12.5 MB/s; the bucket's 1 MB burst passes at the link's own speed
    assert shaped.grpc_mb_s < 12.5 * 4.2 / 3.1 and shaped.gloo_mb_s < 12.5 * 4.2 / 3.1
