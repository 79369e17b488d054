"""Compile a native CPU kernel on first use (torch's C++ extension builder + ninja) into the
tandem cache, keyed by this CPU's instruction-set flags; later processes load the cached
build. A failed build is reported once and the caller keeps its torch fallback."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from engine import envs

_LOADED: dict[str, object] = {}  # name -> module (or None when unavailable)


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            line = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.split(":", 1)[-1].split())


def build(name: str, source: Path, extra_cflags: list[str]):
    """The compiled module, or None: TANDEM_DISABLE_NATIVE_KERNELS=1 (checked on every call,
    so it can change within a process), or the build failed (remembered)."""
    if envs.native_kernels_disabled():
        return None
    if name in _LOADED:
        return _LOADED[name]
    from torch.utils.cpp_extension import load as load_extension

    key = hashlib.blake2b(" ".join(sorted(cpu_flags())).encode(), digest_size=6).hexdigest()
    build_dir = envs.cache_dir() / "torch_extensions" / f"{name}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    module = None
    try:
        module = load_extension(name=name, sources=[str(source)], extra_cflags=extra_cflags,
                                build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler or ninja: keep torch's kernels, and say so
        print(f"[tandem] native kernel {name} unavailable ({exc}); using torch ops", file=sys.stderr)
    _LOADED[name] = module
    return module
