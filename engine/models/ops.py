"""The small fused operations of a decoder layer, in two interchangeable implementations:
``TorchOps`` (plain torch, any device) and ``NativeOps`` (engine/kernels/cpu_ops.cpp, one
call each on the CPU). The model calls them through this interface only."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class TorchOps:
    """Reference implementations with torch ops."""

    name = "torch"
    kernels = None  # no native module behind these

    def add_rms_norm_(self, residual, delta, weight, eps: float) -> torch.Tensor:
        """residual += delta (if given), in place; returns rms_norm(residual) * weight."""
        if delta is not None:
            residual.add_(delta)
        return F.rms_norm(residual, weight.shape, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_state(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Per-step RoPE input shared by every layer: e^{i * angle} [T, 1, head_dim // 2]."""
        return torch.complex(cos[positions], sin[positions]).unsqueeze(1)

    def rope_(self, x: torch.Tensor, state) -> None:
        """Rotate x [T, heads, head_dim] (interleaved pairs) in place."""
        pairs = x.unflatten(-1, (-1, 2))  # [T, heads, head_dim // 2, 2]
        if x.dtype == torch.float32:
            torch.view_as_complex(pairs).mul_(state)
        else:  # no complex bfloat16: rotate in float32 and write back
            pairs.copy_(torch.view_as_real(torch.view_as_complex(pairs.float()) * state))


class NativeOps:
    """The same operations as single native calls (CPU)."""

    name = "native"

    def __init__(self, module) -> None:
        self.kernels = module  # the compiled cpu_ops module (the attention backend uses it too)

    def add_rms_norm_(self, residual, delta, weight, eps: float) -> torch.Tensor:
        return self.kernels.add_rms_norm_(residual, delta, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_mul(gate_up)

    def rope_state(self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return positions, cos, sin

    def rope_(self, x: torch.Tensor, state) -> None:
        positions, cos, sin = state
        self.kernels.rope_(x, positions, cos, sin, x.shape[1])


def select_ops(device: torch.device):
    """Native ops on the CPU when they build here (and are not disabled), else torch."""
    if device.type == "cpu":
        from engine.kernels import cpu_ops

        module = cpu_ops.load()
        if module is not None:
            return NativeOps(module)
    return TorchOps()
