"""Linear layers whose CPU kernel is chosen for the dtype.

On this kind of CPU, torch's default bfloat16 matmul repacks the weight on every call; a
weight packed once by oneDNN (mkldnn) avoids that and reads at a much higher fraction of the
memory bandwidth (see `tandem bench engine`). Float32 keeps torch's default kernel, which is
already the faster one for decode-sized inputs. Results are identical either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with HF-compatible ``weight`` / ``bias`` until ``pack()`` is called."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self._packed: torch.Tensor | None = None  # oneDNN-packed weight; replaces `weight`

    def pack(self) -> None:
        """Pack the weight for oneDNN once (bfloat16 on CPU); a no-op elsewhere."""
        if self._packed is None and can_pack(self.weight.dtype, self.weight.device):
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 1)
            self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    @property
    def weight_nbytes(self) -> int:
        """Bytes a forward reads from the weight (packed or not)."""
        weight = self._packed if self._packed is not None else self.weight
        return self.in_features * self.out_features * weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out]
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
