"""The native kernels built for AVX2 only, for the kernel tests."""

from __future__ import annotations

from pathlib import Path


def avx2_build(name: str, source: Path, native):
    """``source`` built for AVX2 only (-march=haswell; every x86 machine this project runs on has
    it) as ``<name>_avx2``: CI machines differ, and an AVX-512 machine would otherwise never run
    the code its vector extensions compile to on AVX2. On a CPU without AVX-512 the native build
    (``native``) is that code already, and a second compile would only cost time (~60-100 s on 2
    cores for cpu_ops). It is kept in the kernel cache like the native build, so that it is
    compiled once per source."""
    from engine.kernels.build import build, cpu_flags

    if "avx512f" not in cpu_flags():
        return native
    module = build(f"{name}_avx2", source, ["-O3", "-march=haswell", "-fopenmp"])
    assert module is not None, f"the AVX2 build of {name} failed"
    return module
