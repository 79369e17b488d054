"""The native-kernel cache survives processes that die in it: a ``lock`` file that torch's
builder leaves behind, a library cut off mid-write, and a holder killed while it builds; a
live holder is waited for only until the deadline. A library is built once for what it is made
of: a fresh checkout (newer files) imports it, a changed source or header builds anew. Each
check loads a small pybind11 module in a fresh process (as a new worker would) from a private
cache directory."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.kernels import build as kernel_build

NAME = "tandem_test_answer"
SOURCE = """
#include <pybind11/pybind11.h>
#include "answer.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", []() { return ANSWER; }); }
"""
LOAD = textwrap.dedent(f"""
    import sys
    from pathlib import Path
    from engine.kernels.build import build
    module = build({NAME!r}, Path(sys.argv[1]), ["-O0"])
    print("answer", None if module is None else module.answer())
""")


def load_in_new_process(cache: Path, source: Path, timeout_s: float = 240, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD, str(source)], capture_output=True, text=True,
                          timeout=timeout_s, env={**os.environ, "TANDEM_CACHE_DIR": str(cache), **env})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(cache, source, build directory) after one good build."""
    root = tmp_path_factory.mktemp("kernel-cache")
    source = root / "answer.cpp"
    source.write_text(SOURCE)
    (root / "answer.h").write_text("#define ANSWER 42\n")
    cache = root / "cache"
    done = load_in_new_process(cache, source)
    assert "answer 42" in done.stdout, done.stderr
    (build_dir,) = (cache / "torch_extensions").iterdir()
    return cache, source, build_dir


def test_a_lock_left_by_a_dead_builder_is_removed(built):
    cache, source, build_dir = built
    (build_dir / "lock").touch()  # what torch's FileBaton leaves when its process is killed
    try:
        done = load_in_new_process(cache, source, timeout_s=120)  # torch alone waits forever
    finally:
        leftover = (build_dir / "lock").exists()
        (build_dir / "lock").unlink(missing_ok=True)
    assert "answer 42" in done.stdout, done.stderr
    assert "left by a process that died" in done.stderr
    assert not leftover


def test_a_library_cut_off_mid_write_is_rebuilt_not_loaded(built):
    cache, source, build_dir = built
    library = build_dir / f"{NAME}.so"
    head = library.read_bytes()[:4096]
    library.unlink()
    library.write_bytes(head)  # newer than its object file: ninja takes it as current
    done = load_in_new_process(cache, source)
    assert done.returncode == 0, (done.returncode, done.stderr)  # loading it as it was: SIGBUS
    assert "answer 42" in done.stdout, done.stderr
    assert library.stat().st_size > len(head)


def test_a_killed_holder_releases_the_build_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from engine.kernels.build import build_lock
        with build_lock(Path({str(tmp_path)!r}), 5):
            (Path({str(tmp_path)!r}) / "lock").touch()
            print("holding", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        with pytest.raises(TimeoutError):
            with kernel_build.build_lock(tmp_path, 0.5):
                pass
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        started = time.monotonic()
        with kernel_build.build_lock(tmp_path, 10):
            waited = time.monotonic() - started
            assert not (tmp_path / "lock").exists()
        assert waited < 5
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_the_wait_for_a_live_holder_has_a_deadline(tmp_path, built, monkeypatch):
    _, source, _ = built
    cache = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache))
    key_dir = kernel_build.build_directory(NAME, source, ["-O0"])
    key_dir.mkdir(parents=True)
    with open(key_dir / "tandem.flock", "a+") as handle:  # another process building, as far as flock tells
        fcntl.flock(handle, fcntl.LOCK_EX)
        started = time.monotonic()
        done = load_in_new_process(cache, source, timeout_s=60, TANDEM_KERNEL_BUILD_TIMEOUT_S="2")
        took = time.monotonic() - started
    assert "answer None" in done.stdout, done.stderr
    assert "unavailable" in done.stderr and "held" in done.stderr
    assert took < 30
    assert not (key_dir / f"{NAME}.so").exists()  # it did not build behind the holder's back



def built_outputs(build_dir: Path) -> dict[str, int]:
    """What a build wrote, by name and mtime (not the mark each load touches)."""
    return {path.name: path.stat().st_mtime_ns for path in build_dir.iterdir() if path.name != "tandem.used"}


def test_a_fresh_checkout_imports_the_library_built_from_the_same_files(tmp_path):
    """A clone elsewhere has the same bytes in files newer than the cached library, which ninja
    would rebuild; it imports the library as it is. A changed header builds in a directory of
    its own."""
    cache = tmp_path / "cache"

    def checkout(name: str, answer: int) -> Path:
        root = tmp_path / name
        root.mkdir()
        (root / "answer.cpp").write_text(SOURCE)
        (root / "answer.h").write_text(f"#define ANSWER {answer}\n")
        return root / "answer.cpp"

    assert "answer 42" in load_in_new_process(cache, checkout("first", 42)).stdout
    (built_dir,) = (cache / "torch_extensions").iterdir()
    outputs = built_outputs(built_dir)
    clone = checkout("clone", 42)
    later = time.time() + 60
    for path in (clone, clone.with_suffix(".h")):
        os.utime(path, (later, later))  # newer than every build output
    again = load_in_new_process(cache, clone)
    assert "answer 42" in again.stdout, again.stderr
    assert built_outputs(built_dir) == outputs  # nothing compiled
    assert len(list((cache / "torch_extensions").iterdir())) == 1

    changed = load_in_new_process(cache, checkout("changed", 43))
    assert "answer 43" in changed.stdout, changed.stderr
    assert len(list((cache / "torch_extensions").iterdir())) == 2
    assert built_outputs(built_dir) == outputs


def _fake_build(root: Path, name: str, age_days: float | None) -> Path:
    """A build directory of ``name`` last used ``age_days`` ago (None: never marked used)."""
    build_dir = root / name
    build_dir.mkdir(parents=True)
    (build_dir / "tandem.flock").touch()
    (build_dir / "lib.so").write_bytes(b"x" * 100)
    if age_days is not None:
        (build_dir / "tandem.used").touch()
        then = time.time() - age_days * 86400
        os.utime(build_dir / "tandem.used", (then, then))
    return build_dir


def test_a_load_removes_the_kernels_old_builds_that_nobody_uses(built, tmp_path):
    """Every source or flag change builds a directory of its own; loading the kernel removes
    its other directories unused for STALE_BUILD_DAYS, unless a process holds one, and leaves
    the recent ones, other kernels' and anything not named as a build."""
    cache, source, build_dir = built
    root = build_dir.parent
    old = _fake_build(root, f"{NAME}-0123456789abcdef", kernel_build.STALE_BUILD_DAYS + 1)
    recent = _fake_build(root, f"{NAME}-1123456789abcdef", kernel_build.STALE_BUILD_DAYS - 1)
    held = _fake_build(root, f"{NAME}-2123456789abcdef", kernel_build.STALE_BUILD_DAYS + 1)
    other_kernel = _fake_build(root, f"{NAME}_other-0123456789abcdef", kernel_build.STALE_BUILD_DAYS + 1)
    not_a_build = _fake_build(root, f"{NAME}-notes", kernel_build.STALE_BUILD_DAYS + 1)
    try:
        with open(held / "tandem.flock", "a+") as handle:  # a process building or loading it now
            fcntl.flock(handle, fcntl.LOCK_EX)
            done = load_in_new_process(cache, source)
        assert "answer 42" in done.stdout, done.stderr
        assert not old.exists()
        assert all(path.is_dir() for path in (recent, held, other_kernel, not_a_build, build_dir))
        assert time.time() - (build_dir / "tandem.used").stat().st_mtime < 120  # marked used now
    finally:
        for path in (old, recent, held, other_kernel, not_a_build):
            shutil.rmtree(path, ignore_errors=True)


def test_prune_stale_keeps_what_it_was_asked_to_keep(tmp_path):
    keep = _fake_build(tmp_path, "k-0000000000000000", 100)
    stale = _fake_build(tmp_path, "k-1111111111111111", 100)
    unmarked = _fake_build(tmp_path, "k-2222222222222222", None)  # made just now
    assert kernel_build.prune_stale("k", keep, 86400) == [stale]
    assert keep.is_dir() and unmarked.is_dir() and not stale.exists()


def test_a_lock_taken_on_a_directory_removed_meanwhile_is_taken_again(tmp_path):
    """A process waiting for a build directory's flock while another process (a pruner) removes
    the directory ends up holding the flock of the directory made again, which excludes the
    next taker."""
    build_dir = tmp_path / f"{NAME}-0123456789abcdef"
    pruner = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import shutil, sys, time
        from pathlib import Path
        from engine.kernels.build import build_lock
        build_dir = Path(sys.argv[1])
        with build_lock(build_dir, 5):
            print("holding", flush=True)
            time.sleep(1.0)
            shutil.rmtree(build_dir)
    """), str(build_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert pruner.stdout.readline().strip() == "holding"
        with kernel_build.build_lock(build_dir, 30):
            assert pruner.wait(timeout=30) == 0  # it removed the directory while this one waited
            assert (build_dir / "tandem.flock").exists()
            with pytest.raises(TimeoutError):
                with kernel_build.build_lock(build_dir, 0.2):
                    pass
    finally:
        pruner.kill()
        pruner.wait(timeout=10)
