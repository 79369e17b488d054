"""The native kernels compute without the GIL, so that a worker's other Python threads (the
prefill lane, gRPC handlers, the KV transport) run while one of them is inside a kernel. Each
kernel is called on one thread (one torch thread, inputs large enough for tens of ms) while
another thread records the times at which it ran Python; holding the GIL, the kernel would
leave a gap in those times as long as itself. (Counting ticks inside the call is not enough:
at either end of it the other thread may hold the GIL for a switch interval, 5 ms, and leave
a few ticks inside the window even when the kernel holds the GIL.)"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.kernels import cpu_gemv, cpu_ops, prefill_attention


def python_runs_during(call, min_call_s: float = 0.02) -> tuple[float, float]:
    """(the longest time inside one ``call`` in which the other thread ran no Python, the
    call's duration)."""
    ticks: list[float] = []
    stop = threading.Event()
    window: dict[str, float] = {}

    def ticker():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    def caller():
        torch.set_num_threads(1)
        call()  # once unmeasured: first-call costs
        window["start"] = time.perf_counter()
        call()
        window["end"] = time.perf_counter()

    other = threading.Thread(target=ticker)
    other.start()
    try:
        thread = threading.Thread(target=caller)
        thread.start()
        thread.join(120)
    finally:
        stop.set()
        other.join(10)
    start, end = window["start"], window["end"]
    duration = end - start
    assert duration >= min_call_s, f"the call took {duration * 1000:.1f} ms: too short to tell"
    points = [start, *sorted(tick for tick in ticks if start < tick < end), end]
    return max(b - a for a, b in zip(points, points[1:])), duration


def test_cpu_ops_release_the_gil():
    ops = cpu_ops.load()
    assert ops is not None
    x, weight = torch.randn(8, 4096), torch.randn(16384, 4096)
    gap, duration = python_runs_during(lambda: ops.skinny_linear_f32(x, weight, None))
    assert gap < duration / 2, f"no Python ran for {gap * 1000:.0f} of {duration * 1000:.0f} ms of skinny_linear_f32"


def test_bfloat16_kernels_release_the_gil():
    if not cpu_gemv.cpu_supports_avx512_bf16():
        pytest.skip("gemv_bf16 and the prefill attention kernel need AVX-512 BF16; this CPU lacks it")
    gemv = cpu_gemv.load()
    x, weight = torch.randn(8, 8192).bfloat16(), torch.randn(32768, 8192).bfloat16()  # one call: 512 MB of weight
    gap, duration = python_runs_during(lambda: gemv.gemv_bf16(x, weight, None))
    assert gap < duration / 2, f"no Python ran for {gap * 1000:.0f} of {duration * 1000:.0f} ms of gemv_bf16"

    attention = prefill_attention.load()
    q_len, heads, kv_heads, head_dim, block_size = 2048, 9, 3, 64, 16
    query = torch.randn(q_len, heads, head_dim).bfloat16()
    cache = torch.randn(q_len // block_size, block_size, 2 * kv_heads, head_dim).bfloat16()
    table = torch.arange(q_len // block_size, dtype=torch.int64)
    gap, duration = python_runs_during(
        lambda: attention.paged_prefill_attention(query, cache, table, q_len, head_dim ** -0.5))
    assert gap < duration / 2, f"no Python ran for {gap * 1000:.0f} of {duration * 1000:.0f} ms of the attention"
