"""Linear layers whose CPU kernel is chosen for the dtype and the number of rows.

bfloat16 on CPU: decode-sized inputs (up to ``cpu_gemv.MAX_BATCH`` rows) go to tandem's own
AVX-512 BF16 kernel (engine/kernels), which streams the weight near the memory bandwidth;
larger inputs go to oneDNN with a weight packed once at load (torch's default bfloat16 path
repacks the weight on every call). Both copies of the weight are kept, which costs one more
copy of the weights in memory.

float32 on CPU: a weight whose values are exact 4- or 8-bit blocks (a checkpoint dequantized
from a GGUF, as the default model is) keeps those blocks too, and decode batches up to
``BLOCK_MAX_ROWS`` rows multiply by them (engine/kernels/block_linear.py): the same weight in a
fifth of the bytes. Otherwise, up to ``SKINNY_MAX_ROWS`` rows (decode batches) go to
``skinny_linear_f32`` (engine/kernels/cpu_ops.cpp), which reads each weight row once for all
rows of x; BLAS treats a few rows as as many matrix-vector products and streams the weight once
per row. Timing both on SmolLM2-135M's matmuls put the crossover between 4 rows (the kernel
ahead) and 8 (BLAS ahead). Each row's result does not depend on the other rows. README's
small-batch float32 table (`tandem bench engine --dtypes float32 --batch-sizes 1,2,4`) shows
the effect. Above that, where oneDNN with a weight packed once beats torch's default float32
matmul on this CPU (``onednn_f32_faster``, timed once per process), the weight is packed for
oneDNN too: on an AMD EPYC with AVX2 only, torch's default (MKL) took 41 ms for SmolLM2's
output head at 16 rows and oneDNN 14 ms; on CPUs where MKL is as fast, nothing changes.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import block_linear, cpu_gemv, cpu_ops
from engine.kernels.build import cpu_flags

# float32 rows up to which a weight kept as exact blocks (engine/kernels/block_linear.py) is
# multiplied by its blocks; above it the float32 kernels below. SmolLM2-135M's float32 decode
# step at context 320 on 2 cores of the family-25 EPYC: 12 ms against 24-29 at 1 row, 32-36
# against 42-47 at 8, even at 12, 63-70 against 56-57 at 16 (the blocks' kernel is bound by
# its arithmetic there, where oneDNN's packed float32 kernel does more per cycle). On the
# AVX2-only EPYC of family 23: 32 against 43 ms at 1 row, 51 against 111 at 4, 85 against 108 at 8.
BLOCK_MAX_ROWS = 8
SKINNY_MAX_ROWS = 4  # float32 rows up to which skinny_linear_f32 beats BLAS (measured, above)
# oneDNN packs a float32 weight for a batch size; 16 was the fastest of 1/16/64 from 5 to 300
# rows on SmolLM2's shapes (1 was up to 1.4x slower on the output head, 64 no faster)
F32_PACK_ROWS = 16


@functools.cache
def onednn_f32_faster() -> bool:
    """Whether oneDNN with a packed weight beats torch's default float32 matmul by at least 10%
    on this CPU, timed once per process on a decode-sized product (16 rows, 4096 x 576)."""
    if not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4096, 576, generator=generator)
    x = torch.randn(F32_PACK_ROWS, 576, generator=generator)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, F32_PACK_ROWS)
    except RuntimeError:
        return False

    def best_of(call) -> float:
        call()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(4):
                call()
            best = min(best, time.perf_counter() - start)
        return best

    with torch.inference_mode():
        blas = best_of(lambda: F.linear(x, weight))
        onednn = best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return onednn < 0.9 * blas


def _onednn_bf16_cpu() -> bool:
    """oneDNN packs bfloat16 weights only on CPUs with AVX-NE-CONVERT or AVX-512 BW/VL/DQ
    (elsewhere, e.g. AVX2-only machines, it raises; torch's default path is used there)."""
    flags = cpu_flags()
    return "avx_ne_convert" in flags or {"avx512bw", "avx512vl", "avx512dq"} <= flags


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and _onednn_bf16_cpu())


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with HF-compatible ``weight`` / ``bias`` until ``pack()`` is called."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN-packed copy of the weight
        self._gemv = None  # the native skinny-matmul module, when it serves this weight
        self._skinny = None  # cpu_ops, for float32 decode batches (skinny_linear_f32)
        self._blocks: block_linear.Blocks | None = None  # the weight's exact 4/8-bit blocks, for decode batches

    def pack(self) -> None:
        """Prepare the weight for the fastest kernels of its dtype (bfloat16 and float32 on
        CPU); a no-op elsewhere."""
        if self.weight.device.type == "cpu" and self.weight.dtype == torch.float32:
            if self.weight.is_contiguous():
                self._skinny = cpu_ops.load()  # None where the native ops do not build (or are disabled)
            if self._blocks is None:
                self._blocks = block_linear.pack(self.weight)  # None unless the weight is exact blocks
            if self._packed is None and onednn_f32_faster():
                self.pack_onednn_f32()
            return
        if self._packed is not None or not can_pack(self.weight.dtype, self.weight.device):
            return
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
        self._gemv = cpu_gemv.load()
        if self._gemv is None:  # the plain copy is only needed by the native kernel
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def pack_onednn_f32(self) -> None:
        """Serve float32 batches above ``SKINNY_MAX_ROWS`` rows with oneDNN and a packed copy of
        the weight (the plain one stays: the skinny kernel and a tied embedding read it)."""
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), F32_PACK_ROWS)

    @property
    def weight_nbytes(self) -> int:
        """Bytes a decode-sized forward reads from the weight (its blocks, packed or not)."""
        if self._blocks is not None:
            return self._blocks.nbytes
        weight = self._packed if self._packed is not None else self.weight
        return self.in_features * self.out_features * weight.element_size()

    def _native(self, x: torch.Tensor) -> bool:
        return self._gemv is not None and x.shape[0] <= cpu_gemv.MAX_BATCH

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] float32
        """The same product with a float32 result. The native kernel accumulates in float32
        and can skip the rounding to bfloat16 (logits keep their real margins)."""
        if self._native(x):
            return self._gemv.gemv_bf16(x.contiguous(), self.weight, self.bias, True)
        return self(x).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self._blocks is not None and x.shape[0] <= BLOCK_MAX_ROWS:
            return self._blocks.linear(x.contiguous(), self.bias)
        if self._skinny is not None and x.shape[0] <= SKINNY_MAX_ROWS:
            return self._skinny.skinny_linear_f32(x.contiguous(), self.weight, self.bias)
        if self._native(x):
            return self._gemv.gemv_bf16(x.contiguous(), self.weight, self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
