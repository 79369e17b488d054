"""Causal prompt-chunk attention through a block table, bfloat16 on CPUs with AVX-512 BF16
(prefill_attention.cpp): the prefill counterpart of cpu_ops' paged_decode_attention. torch's
CPU flash kernel runs at 50-90 GFLOP/s there; this one at 2-3x that (docs/benchmarks.md).
``load()`` returns None where the CPU lacks the instructions, native kernels are disabled or
the build fails; the attention backend then keeps torch's SDPA."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kernels.build import build
from engine.kernels.cpu_gemv import cpu_supports_avx512_bf16

_SOURCE = Path(__file__).with_name("prefill_attention.cpp")


def load():
    """The compiled module (``paged_prefill_attention``, ``supports``), or None."""
    if not cpu_supports_avx512_bf16():
        return None
    return build("tandem_prefill_attention", _SOURCE, ["-O3", "-march=native", "-fopenmp"])


def for_model(arch, dtype, device):
    """The module where it takes this model's prefill attention (a CPU, bfloat16, head_dim 64
    or 128, 1-8 query heads per KV head), else None. ``arch``: a ModelArchConfig."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    module = load()
    group = arch.num_attention_heads // arch.num_key_value_heads
    return module if module is not None and module.supports(arch.head_dim, group) else None
