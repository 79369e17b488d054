"""What this machine can do: memory read bandwidth, measured in the same run as a benchmark."""

from __future__ import annotations

import os
import platform
import sys
import time

import torch


def describe() -> str:
    """CPU model, core count, torch version and OS, for a benchmark's header."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores, {instruction_sets()}), torch {torch.__version__}, {sys.platform}"


def instruction_sets() -> str:
    """The vector instruction sets that decide which kernels run fast here."""
    try:
        with open("/proc/cpuinfo") as handle:
            flags = set(next(line for line in handle if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "instruction sets unknown"
    found = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if name in flags]
    return "+".join(found) or "no AVX2"


def read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s that torch's threads read from memory (best of ``repeats`` full reductions
    over a buffer far larger than the caches)."""
    buffer = torch.ones(num_bytes // 4, dtype=torch.float32)
    buffer.sum()  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return num_bytes / best
