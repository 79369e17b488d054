"""A skinny bfloat16 matmul for decode on CPUs with AVX-512 BF16 (gemv_bf16.cpp).

torch's own bfloat16 kernels read decode-sized weights at well under the memory bandwidth on
such CPUs; this one streams each weight once with AVX-512 BF16 dot products and software
prefetch. Where the CPU lacks the instructions or the build fails, ``load()`` returns None
and callers keep torch's kernels.
"""

from __future__ import annotations

from pathlib import Path

from engine.kernels.build import build, cpu_flags

MAX_BATCH = 4  # rows up to which the native kernel beats oneDNN here; more rows use oneDNN
_SOURCE = Path(__file__).with_name("gemv_bf16.cpp")


def cpu_supports_avx512_bf16() -> bool:
    return {"avx512f", "avx512_bf16"} <= cpu_flags()


def load():
    """The compiled module (with ``gemv_bf16``), or None where it cannot be used here."""
    if not cpu_supports_avx512_bf16():
        return None
    return build("tandem_gemv_bf16", _SOURCE, ["-O3", "-mavx512f", "-mavx512bf16", "-fopenmp"])
