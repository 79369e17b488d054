"""Fused CPU ops for the decode path (cpu_ops.cpp): add + RMSNorm, SiLU * up, in-place RoPE,
and paged decode attention that reads K/V through block tables. ``load()`` returns None
where they cannot be built; the model then uses the equivalent torch ops."""

from __future__ import annotations

from pathlib import Path

from engine.kernels.build import build

_SOURCE = Path(__file__).with_name("cpu_ops.cpp")


def load():
    return build("tandem_cpu_ops", _SOURCE, ["-O3", "-march=native", "-fopenmp"])
