"""What this machine runs fastest: the `auto` dtype is measured, not guessed."""

from __future__ import annotations

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
