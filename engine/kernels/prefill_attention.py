"""Causal prompt-chunk attention through a block table, bfloat16 on CPUs with AVX-512 BF16
(prefill_attention.cpp): the prefill counterpart of cpu_ops' paged_decode_attention. torch's
CPU flash kernel runs at 50-90 GFLOP/s there; this one at 2-3x that (docs/benchmarks.md).
``load()`` returns None where the CPU lacks the instructions, native kernels are disabled or
the build fails; the attention backend then keeps torch's SDPA.

Where the CPU also has AMX, the engine does not use it (``for_model``): there torch's flash
attention multiplies its tiles through oneDNN's brgemm on AMX, and is the faster of the two
(docs/benchmarks.md "Prefill attention on AMX")."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.kernels.build import build, cpu_flags
from engine.kernels.cpu_gemv import cpu_supports_avx512_bf16

_SOURCE = Path(__file__).with_name("prefill_attention.cpp")


def load():
    """The compiled module (``paged_prefill_attention``, ``supports``), or None."""
    if not cpu_supports_avx512_bf16():
        return None
    return build("tandem_prefill_attention", _SOURCE, ["-O3", "-march=native", "-fopenmp"])


def sdpa_is_faster() -> bool:
    """This CPU has AMX for bfloat16, which torch's SDPA uses and this kernel does not. On a
    2-core Xeon with AMX, one thread, SmolLM2's heads: 5.2-6.9 against 15.9-16.8 ms a layer at
    1024 positions, 0.5 against 1.1-1.3 at 256; a 1024-token prompt 453-463 against 710-756 ms."""
    return {"amx_bf16", "amx_tile"} <= cpu_flags()


def for_model(arch, dtype, device):
    """The module where it takes this model's prefill attention (a CPU without AMX, bfloat16,
    head_dim 64 or 128, 1-8 query heads per KV head), else None. ``arch``: a ModelArchConfig."""
    if device.type != "cpu" or dtype != torch.bfloat16 or sdpa_is_faster():
        return None
    module = load()
    group = arch.num_attention_heads // arch.num_key_value_heads
    return module if module is not None and module.supports(arch.head_dim, group) else None
