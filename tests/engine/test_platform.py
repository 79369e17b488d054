"""The `auto` dtype follows the measured matmul speed."""

from __future__ import annotations

import torch

from engine import platform


def test_auto_dtype_follows_measurement(monkeypatch):
    platform.auto_dtype.cache_clear()
    speeds = {torch.float32: 1.0, torch.bfloat16: 0.5}
    monkeypatch.setattr(platform, "_time_linear", lambda dtype, *a: speeds[dtype])
    assert platform.auto_dtype("cpu", 64, 128) is torch.bfloat16
    platform.auto_dtype.cache_clear()
    speeds[torch.bfloat16] = 0.95  # under 10% faster: not worth the precision
    assert platform.auto_dtype("cpu", 64, 128) is torch.float32
    assert platform.auto_dtype("cuda", 64, 128) is torch.bfloat16
    platform.auto_dtype.cache_clear()

