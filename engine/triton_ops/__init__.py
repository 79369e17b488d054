"""Triton kernels for the GPU path, one module per kernel with its launcher:

- ``paged_decode``: one query token per sequence against its paged K/V (GQA in the kernel),
  single pass or split-K (flash-decoding) with a reduction kernel;
- ``paged_prefill``: chunks of new tokens attending causally to themselves and their cached
  prefix, varlen (``cu_seqlens``);
- ``kv_write``: new K/V scattered into cache blocks by slot mapping;
- ``kv_pack``: a request's blocks over a layer range into one contiguous buffer, and back.

Each launcher checks shapes, dtypes and strides, computes the grid, and counts its launches in
``LAUNCHES`` (tests use it to prove a kernel ran). The kernels run on CUDA tensors, or on CPU
tensors under ``TRITON_INTERPRET=1`` (how the tests check them without a GPU). Importing this
package does not import triton; the kernel modules do.
"""

from engine.triton_ops.common import (
    LAUNCHES,
    TritonUnavailable,
    interpreting,
    triton_unavailable_reason,
)

__all__ = ["LAUNCHES", "TritonUnavailable", "interpreting", "triton_unavailable_reason"]
