"""Ray worker processes on this machine, told by their title: Ray renames each worker process
``ray::Class.method`` (``ray::IDLE`` between tasks), and that title is what the process's
command line reads. No Ray import here, so that a benchmark (which only watches) and `tandem
serve`'s stop (which must not wait on Ray to find what to kill) can use it alike.

Read from ``/proc`` (Linux); where there is none, no process is found. A process that ended
and was not yet waited for (a zombie) has an empty command line, so it is never counted, and a
pid the kernel has since given to another program is not taken for the worker it was."""

from __future__ import annotations

import os
from collections.abc import Iterable

PREFIX = b"ray::"


def runs_ray_worker(pid: int, actor: str = "") -> bool:
    """Process ``pid`` exists and runs a Ray worker; with ``actor``, one of that class
    (``WorkerActor``: its title starts ``ray::WorkerActor``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return cmdline.read().startswith(PREFIX + actor.encode())
    except OSError:  # no such process (any more), or no /proc
        return False


def ray_worker_pids(actor: str = "", among: Iterable[int] | None = None) -> list[int]:
    """The pids, ascending, of the processes running Ray workers (of class ``actor`` when
    given), among ``among`` or, by default, every process on this machine."""
    if among is None:
        try:
            among = (int(name) for name in os.listdir("/proc") if name.isdigit())
        except OSError:
            return []
    return sorted(pid for pid in set(among) if runs_ray_worker(pid, actor))
