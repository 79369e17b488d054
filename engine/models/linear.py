"""Linear layers whose CPU kernel is chosen for the dtype and the number of rows.

bfloat16 on CPU: decode-sized inputs (up to ``cpu_gemv.MAX_BATCH`` rows) go to tandem's own
AVX-512 BF16 kernel (engine/kernels), which streams the weight near the memory bandwidth;
larger inputs go to oneDNN with a weight packed once at load (torch's default bfloat16 path
repacks the weight on every call). Both copies of the weight are kept, which costs one more
copy of the weights in memory. oneDNN packs a weight for a batch size, and on a Xeon with AMX
the copy packed for one row made products of 257 to ~350 rows as slow as 512 (1.42 against
0.81 ms for SmolLM2's four matmuls of a layer at 272 rows; the same below 256 rows, and
faster again from ~450 to 1024): that is where a step with a 250-token prompt and its decodes
lands. Where a copy packed for ``BF16_MID_PACK_ROWS`` rows is measurably faster there
(``onednn_bf16_mid_pack_faster``, timed once per process), the weight is packed that way too
and serves rows in ``(BF16_MID_PACK_ROWS, BF16_MID_MAX_ROWS]``: a third copy in memory
(``TANDEM_ONEDNN_MID_PACK=0``: never, for comparisons).

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

from engine import envs
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
# bfloat16: the second oneDNN copy's batch size and the rows it serves (above the first number,
# up to the second). On a 2-core Xeon with AMX (model 167), SmolLM2's four matmuls of a layer
# at 256 / 272 / 300 / 350 / 400 / 450 / 512 rows: 0.80 / 1.42 / 1.41 / 1.38 / 1.42 / 1.47 /
# 1.47 ms packed for one row, 0.81 / 0.81 / 0.95 / 1.19 / 1.38 / 1.53 / 1.73 packed for 256.
BF16_MID_PACK_ROWS = 256
BF16_MID_MAX_ROWS = 352


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

    with torch.inference_mode():
        blas = _best_of(lambda: F.linear(x, weight))
        onednn = _best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return onednn < 0.9 * blas


def _best_of(call, repeats: int = 5, calls: int = 4) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, time.perf_counter() - start)
    return best


@functools.cache
def onednn_bf16_mid_pack_faster() -> bool:
    """Whether a bfloat16 weight packed for ``BF16_MID_PACK_ROWS`` rows beats the one packed for
    one row by at least 15% on products just above that many rows here (288 rows of SmolLM2's
    largest matmul shape, 3072 x 576), timed once per process on this process's threads."""
    if envs.onednn_mid_pack_disabled() or not can_pack(torch.bfloat16, torch.device("cpu")):
        return False
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3072, 576, generator=generator).to(torch.bfloat16)
    x = torch.randn(BF16_MID_PACK_ROWS + 32, 576, generator=generator).to(torch.bfloat16)
    try:
        for_one = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        for_mid = torch.ops.mkldnn._reorder_linear_weight(weight, BF16_MID_PACK_ROWS)
    except RuntimeError:
        return False
    with torch.inference_mode():
        one = _best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, for_one, None, "none", [], ""))
        mid = _best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, for_mid, None, "none", [], ""))
    return mid < 0.85 * one


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
        self._packed_mid: torch.Tensor | None = None  # bfloat16, packed for BF16_MID_PACK_ROWS rows (see above)
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
        if onednn_bf16_mid_pack_faster():
            self._packed_mid = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), BF16_MID_PACK_ROWS)
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
        if self._packed_mid is not None and BF16_MID_PACK_ROWS < x.shape[0] <= BF16_MID_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed_mid, self.bias, "none", [], "")
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
