"""A skinny bfloat16 matmul for decode on CPUs with AVX-512 BF16, built on first use.

torch's own bfloat16 kernels read decode-sized weights at well under the memory bandwidth on
such CPUs; this one streams the weight once with AVX-512 BF16 dot products. It is compiled
with torch's C++ extension builder into the tandem cache, once per machine. Where the CPU
lacks the instructions or no compiler is available, ``load()`` returns None and callers keep
torch's kernels.
"""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

from engine import envs

MAX_BATCH = 4  # rows up to which the native kernel beats oneDNN here; more rows use oneDNN
_SOURCE = Path(__file__).with_name("gemv_bf16.cpp")


def cpu_supports_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as handle:
            flags = next((line for line in handle if line.startswith("flags")), "")
    except OSError:
        return False
    return "avx512_bf16" in flags.split() and "avx512f" in flags.split()


@lru_cache(maxsize=1)
def load():
    """The compiled module (with ``gemv_bf16``), or None where it cannot be used here."""
    if os.environ.get("TANDEM_DISABLE_NATIVE_KERNELS") == "1" or not cpu_supports_avx512_bf16():
        return None
    from torch.utils.cpp_extension import load as load_extension

    build_dir = envs.cache_dir() / "torch_extensions" / "gemv_bf16"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load_extension(
            name="tandem_gemv_bf16",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bf16", "-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, ...: keep torch's kernels, say why
        print(f"[tandem] native bfloat16 kernel unavailable ({exc}); using torch's", file=sys.stderr)
        return None
