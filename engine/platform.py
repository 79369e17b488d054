"""What this machine runs fastest: the `auto` dtype is measured, not guessed."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import time
from functools import lru_cache

import torch
import torch.nn.functional as F


def _time_linear(dtype: torch.dtype, rows: int, in_features: int, out_features: int, repeats: int) -> float:
    x = torch.randn(rows, in_features).to(dtype)
    w = torch.randn(out_features, in_features).to(dtype)
    F.linear(x, w)  # warm up kernels
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return time.perf_counter() - start


_PR_SET_NAME = 15  # prctl(2): this thread's name, 15 bytes at most


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None


def name_native_thread(name: str | None = None) -> None:
    """Give the calling thread's Python name (or ``name``) to the OS thread as well, so that
    ``top -H``, ``ps -L``, py-spy and /proc/PID/task/*/comm tell a worker's engine, lane and
    aio threads apart (Python 3.11 names only the Python object). Linux only; elsewhere, or
    if the call fails, nothing happens."""
    libc = _libc()
    if libc is not None:
        label = (name or threading.current_thread().name).encode()[:15]
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(label), 0, 0, 0)


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto``: CUDA when available, else the CPU. Asking for CUDA without it is an error."""
    if str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device} is not supported (cpu, cuda, auto)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} was asked for, but CUDA is not available here")
    return device


@lru_cache(maxsize=8)
def auto_dtype(device: str, hidden_size: int, intermediate_size: int) -> torch.dtype:
    """bfloat16 on CUDA; on the CPU, bfloat16 only if its matmuls (decode-sized and
    prefill-sized) beat float32 here by at least 10%, else float32."""
    if device == "cuda":
        return torch.bfloat16
    totals = {}
    for dtype in (torch.float32, torch.bfloat16):
        totals[dtype] = sum(
            _time_linear(dtype, rows, hidden_size, intermediate_size, repeats)
            for rows, repeats in ((1, 30), (8, 20), (256, 3))
        )
    return torch.bfloat16 if totals[torch.bfloat16] < 0.9 * totals[torch.float32] else torch.float32
