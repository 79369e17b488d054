"""Compile a native CPU kernel on first use (torch's C++ extension builder + ninja) into the
tandem cache, in a directory keyed by what the library is made of: this CPU's instruction-set
flags, the source and the headers beside it, the compiler flags, and the torch and Python
versions. A later process, or a fresh checkout whose files are all newer than the library
(ninja would rebuild it), imports the cached library without a build. A failed build is
reported once and the caller keeps its torch fallback.

Processes that share the cache (workers of one node, pods on one volume) take turns through
an flock, which the kernel releases when its holder dies. torch's own guard is a ``lock`` file
that a process killed while building or loading leaves behind, and every later process would
wait on it forever; under the flock no live tandem process can own such a file, so it is
removed. The wait for the flock has a deadline (``TANDEM_KERNEL_BUILD_TIMEOUT_S``), after
which the torch ops are used. A library is loaded again only if a stamp written after it last
loaded names it (size and mtime); otherwise the directory is built afresh.

Each load marks its directory used (``tandem.used``). Every source or compiler change is a
directory of its own (about 2 MB), so a load also removes the same kernel's other directories
that no process has used for ``STALE_BUILD_DAYS`` and that no process holds now (their flock
taken without waiting); a library a running process has loaded stays mapped when removed."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

from engine import envs

_LOADED: dict[str, object] = {}  # name -> module (or None when unavailable)
STALE_BUILD_DAYS = 14.0  # a kernel's other build directories unused this long are removed


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def build_directory(name: str, source: Path, extra_cflags: list[str]) -> Path:
    """Where ``name`` is built from ``source`` with ``extra_cflags`` for this CPU, torch and
    Python: a change to any of them (or to a header in the source's directory) is a new one."""
    import torch

    key = hashlib.blake2b(digest_size=8)
    for part in (" ".join(sorted(cpu_flags())), " ".join(extra_cflags), torch.__version__, platform.python_version()):
        key.update(part.encode() + b"\0")
    for path in [source, *sorted(source.parent.glob("*.h"))]:
        key.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return envs.cache_dir() / "torch_extensions" / f"{name}-{key.hexdigest()}"


def build(name: str, source: Path, extra_cflags: list[str]):
    """The compiled module, or None: TANDEM_DISABLE_NATIVE_KERNELS=1 (checked on every call,
    so it can change within a process), or the build failed (remembered)."""
    if envs.native_kernels_disabled():
        return None
    if name in _LOADED:
        return _LOADED[name]
    from torch.utils.cpp_extension import load as load_extension

    module = None
    try:
        build_dir = build_directory(name, source, extra_cflags)
        with build_lock(build_dir, envs.kernel_build_timeout_s()):
            library, stamp = build_dir / f"{name}.so", build_dir / "tandem.ok"
            if library.exists() and stamp.exists() and stamp.read_text() == _identity(library):
                _LOADED[name] = module = _import(name, library)  # known to have loaded: no ninja
                _used(name, build_dir)
                return module
            if library.exists():
                # Not known to have loaded: a linker killed mid-write leaves a library that ninja
                # takes as current and whose loading crashes the process (SIGBUS), not raises.
                _empty(build_dir)
            def load():
                return load_extension(name=name, sources=[str(source)], extra_cflags=extra_cflags,
                                      build_directory=str(build_dir), verbose=False)

            try:
                module = load()
            except Exception:
                # A build cut off part way (a truncated object or library that ninja takes as
                # current) fails the same way every time: start the directory afresh, once.
                _empty(build_dir)
                _forget(name)
                module = load()
            partial = stamp.with_suffix(".partial")
            partial.write_text(_identity(library))
            partial.replace(stamp)
        _used(name, build_dir)
    except Exception as exc:  # no compiler or ninja, or the wait ran out: keep torch's kernels, and say so
        print(f"[tandem] native kernel {name} unavailable ({exc}); using torch ops", file=sys.stderr)
    _LOADED[name] = module
    return module


@contextlib.contextmanager
def build_lock(build_dir: Path, timeout_s: float):
    """Make ``build_dir`` if need be, hold its flock (TimeoutError after ``timeout_s``) and clear
    a ``lock`` file that a dead process left for torch's builder. A flock taken on a directory
    that ``prune_stale`` removed meanwhile guards nothing: the directory is made again and its
    new flock taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        build_dir.mkdir(parents=True, exist_ok=True)
        try:
            handle = open(build_dir / "tandem.flock", "a+")
        except FileNotFoundError:  # removed between the two: make it again
            continue
        try:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"another process held {build_dir} for {timeout_s:.0f} s") from None
                    time.sleep(0.1)
            if _still_there(handle, build_dir / "tandem.flock"):
                break
        except BaseException:
            handle.close()
            raise
        handle.close()  # removed while this process waited: lock the one made now
    with handle:
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"[tandem] removing {stale}, left by a process that died while building", file=sys.stderr)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _still_there(handle, path: Path) -> bool:
    """``handle`` is the file now at ``path`` (not one removed since it was opened)."""
    try:
        return path.stat().st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def _used(name: str, build_dir: Path) -> None:
    """Mark ``build_dir`` used now and remove ``name``'s stale other directories
    (``prune_stale``); neither may fail the load that called it."""
    try:
        (build_dir / "tandem.used").touch()
        prune_stale(name, build_dir, STALE_BUILD_DAYS * 86400.0)
    except OSError as exc:
        print(f"[tandem] could not prune old builds of {name} ({exc})", file=sys.stderr)


def prune_stale(name: str, keep: Path, max_age_s: float) -> list[Path]:
    """Remove ``name``'s build directories beside ``keep`` (``name-<16 hex digits>``) whose last
    use (``tandem.used``, else the stamp, else the directory) is more than ``max_age_s`` ago and
    whose flock no process holds; the ones removed."""
    pattern = re.compile(rf"{re.escape(name)}-[0-9a-f]{{16}}")
    removed = []
    for other in sorted(keep.parent.iterdir()):
        if other == keep or not other.is_dir() or not pattern.fullmatch(other.name) or not _stale(other, max_age_s):
            continue
        try:
            with build_lock(other, 0.0):
                if _stale(other, max_age_s):  # again, now that no other process can be loading it
                    shutil.rmtree(other)
                    removed.append(other)
        except TimeoutError:  # building or loading now: in use
            continue
    return removed


def _stale(build_dir: Path, max_age_s: float) -> bool:
    """Last used (``tandem.used``, else the stamp, else the directory made) over ``max_age_s`` ago."""
    mark = next(m for m in (build_dir / "tandem.used", build_dir / "tandem.ok", build_dir) if m.exists())
    return time.time() - mark.stat().st_mtime > max_age_s


def _import(name: str, library: Path):
    import torch  # noqa: F401  (the library links against torch's, which must be loaded first)

    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _identity(library: Path) -> str:
    info = library.stat()
    return f"{info.st_size} {info.st_mtime_ns}"


def _forget(name: str) -> None:
    """torch remembers in-process which extensions it built and would not build this one again."""
    from torch.utils import cpp_extension

    entries = getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


def _empty(build_dir: Path) -> None:
    for entry in build_dir.iterdir():
        if entry.name == "tandem.flock":  # held by this process
            continue
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
