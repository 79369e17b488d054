"""A second host on this machine: a Linux network namespace joined to the host by a private
veth link (issue 25).

Processes started in the namespace (``NamespaceLink.command``) see only its loopback and its
end of the link, so what they reach on the host they reach over a real interface, by the
host end's address, as on another node; what the host reaches of them, likewise. The link
can be taken down and brought back (``set_link``: a partition, no packet passes and no
connection is told) and shaped (``limit_rate``: ``tc tbf``). ``remove`` (and leaving the
``with`` block) kills every process in the namespace and deletes the namespace and the link,
whatever happened before.

Addresses come from 10.213.0.0/16, one /30 per link, chosen at random among those no
interface here uses; names carry a random tag, so that several test sessions can run at once.
Making namespaces needs root and iproute2 (``namespace_support`` says why not, for a skip)."""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time

SUBNET = ipaddress.ip_network("10.213.0.0/16")


class NamespaceUnavailable(RuntimeError):
    """A namespace or its link could not be made here."""


def _ip(*argv: str, check: bool = True, timeout_s: float = 10.0) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True, timeout=timeout_s)
    if check and done.returncode != 0:
        raise NamespaceUnavailable(f"ip {' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def _used_networks() -> list[ipaddress.IPv4Network]:
    networks = []
    for line in _ip("-o", "-4", "addr", "show").stdout.splitlines():
        fields = line.split()
        if "inet" in fields:
            networks.append(ipaddress.ip_interface(fields[fields.index("inet") + 1]).network)
    return networks


def _free_link_network() -> ipaddress.IPv4Network:
    used = _used_networks()
    links = list(SUBNET.subnets(new_prefix=30))
    for _ in range(64):
        candidate = random.choice(links)
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise NamespaceUnavailable(f"no free /30 left in {SUBNET}")


def namespace_support() -> str | None:
    """None where a namespace and its link can be made here; else why not."""
    if sys.platform != "linux":
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "making a network namespace needs root"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    try:
        with NamespaceLink():
            pass
    except (NamespaceUnavailable, OSError, subprocess.SubprocessError) as exc:
        return f"a network namespace could not be made: {exc}"
    return None


class NamespaceLink:
    """One namespace and the veth pair between it and the host. ``host_ip`` is the host end's
    address (what processes in the namespace reach the host by), ``ns_ip`` the namespace
    end's."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        self.name = f"tandem-{tag}"
        self.host_if, self.ns_if = f"tdm{tag}h", f"tdm{tag}n"  # interface names: at most 15 characters
        self.network: ipaddress.IPv4Network | None = None
        self.host_ip = self.ns_ip = ""
        self.created = False

    def create(self) -> NamespaceLink:
        self.network = _free_link_network()
        host, peer = list(self.network.hosts())
        self.host_ip, self.ns_ip = str(host), str(peer)
        self.created = True  # from here on, remove() undoes whatever part was made
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            _ip("link", "set", self.ns_if, "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/{self.network.prefixlen}", "dev", self.host_if)
            _ip("link", "set", self.host_if, "up")
            for argv in (("addr", "add", f"{self.ns_ip}/{self.network.prefixlen}", "dev", self.ns_if),
                         ("link", "set", self.ns_if, "up"), ("link", "set", "lo", "up")):
                _ip("netns", "exec", self.name, "ip", *argv)
        except BaseException:
            self.remove()
            raise
        return self

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def set_link(self, up: bool) -> None:
        """Bring the link up, or take it down: the host end down leaves both ends without
        carrier, and every packet between them is dropped (no reset reaches either side)."""
        _ip("link", "set", self.host_if, "up" if up else "down")
        if up:  # carrier comes back a moment later: until then a connect fails at once
            self._wait_carrier()

    def _wait_carrier(self, timeout_s: float = 10.0) -> None:
        ends = ((self.host_if, []), (self.ns_if, ["ip", "netns", "exec", self.name]))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [subprocess.run([*prefix, "cat", f"/sys/class/net/{device}/operstate"], capture_output=True,
                                     text=True, timeout=10).stdout.strip() for device, prefix in ends]
            if states == ["up", "up"]:
                return
            time.sleep(0.05)
        raise NamespaceUnavailable(f"the link {self.host_if} did not come up within {timeout_s:g} s")

    def limit_rate(self, rate: str | None, burst: str = "1mb", latency: str = "50ms") -> None:
        """Shape both directions of the link to ``rate`` (tc's units, e.g. ``1gbit``) with a
        token bucket; None removes the shaping."""
        for prefix in ([], ["ip", "netns", "exec", self.name]):
            device = self.ns_if if prefix else self.host_if
            subprocess.run([*prefix, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True, timeout=10)
            if rate is not None:
                done = subprocess.run([*prefix, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate,
                                       "burst", burst, "latency", latency], capture_output=True, text=True, timeout=10)
                if done.returncode != 0:
                    raise NamespaceUnavailable(f"tc tbf on {device}: {done.stderr.strip()}")

    def pids(self) -> list[int]:
        """Every process whose network is this namespace."""
        done = _ip("netns", "pids", self.name, check=False)
        return [int(pid) for pid in done.stdout.split()] if done.returncode == 0 else []

    def kill_all(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def remove(self) -> None:
        if not self.created:
            return
        self.kill_all()
        _ip("link", "del", self.host_if, check=False)  # deletes its peer too, wherever it is
        _ip("netns", "del", self.name, check=False)
        self.created = False

    def __enter__(self) -> NamespaceLink:
        return self.create()

    def __exit__(self, *exc) -> None:
        self.remove()
