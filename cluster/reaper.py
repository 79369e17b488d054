"""What stops a SIGKILLed `tandem serve`'s processes: a small watcher process it starts first.

A process killed by SIGKILL runs no cleanup, and not everything it started dies with it (Ray's
agents outlive their raylet). The reaper keeps the list of the command's descendants (the Ray
head it started, its workers, the private Redis), refreshed every ``POLL_S``; when its parent
is gone (a parent-death signal says so at once on Linux, the poll otherwise), it kills every
process on that list and their children, then exits. When `tandem serve` stops normally, the
list is already empty or nearly so. Run as ``python -m cluster.reaper PARENT_PID``."""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil

POLL_S = 0.5


def _descendants(parent: psutil.Process) -> dict[int, psutil.Process]:
    try:
        found = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    return {process.pid: process for process in found if process.pid != os.getpid()}


def _kill_all(known: dict[int, psutil.Process]) -> None:
    victims = dict(known)
    for process in list(victims.values()):
        try:
            victims.update({child.pid: child for child in process.children(recursive=True)})
        except psutil.NoSuchProcess:
            continue
    victims.pop(os.getpid(), None)
    for process in victims.values():
        try:
            process.kill()  # psutil checks the pid was not reused (create time) before signalling
        except psutil.NoSuchProcess:
            continue


def watch(parent_pid: int) -> None:
    parent = psutil.Process(parent_pid)
    gone = []
    signal.signal(signal.SIGTERM, lambda *_: gone.append(True))  # the parent-death signal
    known: dict[int, psutil.Process] = {}
    while not gone and parent.is_running() and os.getppid() == parent_pid:
        known.update(_descendants(parent))
        known = {pid: p for pid, p in known.items() if p.is_running()}
        time.sleep(POLL_S)
    _kill_all(known)


def start(parent_pid: int | None = None):
    """Start the reaper for this process (``parent_pid``: this one); from the main thread, as the
    parent-death signal belongs to the thread that starts the child. Returns its Popen."""
    import subprocess

    from cluster.redis_server import die_with_parent

    return subprocess.Popen([sys.executable, "-m", "cluster.reaper", str(parent_pid or os.getpid())],
                            stdin=subprocess.DEVNULL, preexec_fn=lambda: die_with_parent(signal.SIGTERM))


if __name__ == "__main__":
    watch(int(sys.argv[1]))
