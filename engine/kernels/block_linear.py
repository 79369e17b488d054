"""Decode matmuls on float32 weights kept as exact 4- or 8-bit blocks (block_linear.cpp).

A checkpoint dequantized from a GGUF holds float32 weights that are llama.cpp's Q4_1 or Q8_0
block values. ``pack`` finds those blocks and keeps them only if they give back every element
bit for bit, so the packed copy is the same weight at 6 or 9 bits an element (the scales as
float32); the matmul rebuilds each block in registers, once for all rows of x, and accumulates
in float32. A decode step reads each weight once, so it reads about a fifth (Q4_1) or a third
(Q8_0) of the bytes. ``load()`` returns None where the kernel cannot be built;
TANDEM_EXACT_BLOCKS=0 leaves every weight as it is (the float32 kernels), for comparisons.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import envs
from engine.kernels.build import build

_SOURCE = Path(__file__).with_name("block_linear.cpp")


def load():
    return build("tandem_block_linear", _SOURCE, ["-O3", "-march=native", "-fopenmp"])


@dataclass(frozen=True, slots=True)
class Blocks:
    """A weight's exact blocks and the kernel that multiplies by them."""

    kind: str  # "q4_1" or "q8_0"
    tensors: tuple[torch.Tensor, ...]  # qs, d (and m for q4_1)
    kernel: Callable  # (x, *tensors, bias) -> x W^T (+ bias): the module's q4_1_linear or q8_0_linear

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.kernel(x, *self.tensors, bias)


def pack(weight: torch.Tensor, module=None) -> Blocks | None:
    """``weight``'s exact Q4_1 blocks, else its exact Q8_0 blocks, else None (also where the
    kernel is unavailable or disabled)."""
    module = module or (None if envs.exact_blocks_disabled() else load())
    if module is None or weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    weight = weight.detach().contiguous()
    for kind, packer, kernel in (("q4_1", module.pack_q4_1, module.q4_1_linear),
                                 ("q8_0", module.pack_q8_0, module.q8_0_linear)):
        tensors = packer(weight)
        if tensors:
            return Blocks(kind, tuple(tensors), kernel)
    return None
