"""Two hosts on one machine (issue 25): the host and a network namespace joined to it by a veth
link (bench/netns.py), a Ray head on the host end's address and a Ray worker node in the
namespace joined to it with the head's token, as on a real cluster. `tandem serve
--ray-address` runs on the host and places each role's workers by the custom resource the
nodes offer. Skipped, with the reason, where namespaces cannot be made (not root, no
iproute2); on the machines CI runs on they can."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from bench.launch import RayHead, RayNode
from bench.netns import NamespaceLink, namespace_support
from tests.otlp import HttpOTLPReceiver
from tests.router.conftest import LiveServer, start_server

ROLES = ("prefill", "decode")


@pytest.fixture(scope="session")
def namespaces() -> None:
    reason = namespace_support()
    if reason is not None:
        pytest.skip(f"two-node tests need network namespaces: {reason}")


@dataclass
class TwoNodes:
    link: NamespaceLink
    head: RayHead  # the host's node: the router and the other role's workers
    node: RayNode  # the namespace's node
    remote_role: str  # the role whose workers run in the namespace
    receiver: HttpOTLPReceiver  # on the host end of the link, where both nodes' workers export

    @property
    def local_role(self) -> str:
        return next(role for role in ROLES if role != self.remote_role)

    def serve(self, model_dir, *extra: str) -> LiveServer:
        """`tandem serve --ray-address` on the host, every prompt through a prefill worker,
        traced to ``receiver``."""
        return start_server(model_dir, "auto", "--ray-address", self.head.address, "--local-prefill-max-tokens", "0",
                            "--otlp-endpoint", self.receiver.url, *extra,
                            env={**self.head.join_env, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})


@contextmanager
def two_nodes(remote_role: str, ray_env: dict[str, str] | None = None) -> Iterator[TwoNodes]:
    """The link, a head on the host (offering the other role) and a node in the namespace
    (offering ``remote_role``, one CPU); all removed on the way out. ``ray_env``: Ray settings
    for both nodes (health-check periods)."""
    local_role = next(role for role in ROLES if role != remote_role)
    with NamespaceLink() as link:
        head = RayHead({local_role: 2}, num_cpus=2, node_ip=link.host_ip)
        head.env.update(ray_env or {})
        node = RayNode(head, {remote_role: 2}, num_cpus=1, node_ip=link.ns_ip, wrap=link.command)
        receiver = HttpOTLPReceiver(host=link.host_ip)
        try:
            head.start()
            node.start()
            yield TwoNodes(link, head, node, remote_role, receiver)
        finally:
            receiver.stop()
            node.stop()
            head.stop()


def worker_addresses(server: LiveServer) -> dict[str, list[str]]:
    """role -> the addresses the router knows its workers by (from /metrics)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found: dict[str, list[str]] = {role: [] for role in ROLES}
    for address, role in re.findall(r'^tandem:worker_healthy\{address="([^"]+)",role="(\w+)"\} 1\.0$', text, re.M):
        found[role].append(address)
    return found
