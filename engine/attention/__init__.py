"""Attention backends: how the model reads and writes the paged KV cache."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionBackend

BACKENDS = ("auto", "torch", "triton")


def make_attention_backend(name: str, device: torch.device | str, dtype: torch.dtype, native=None,
                           prefill=None) -> AttentionBackend:
    """``auto``: Triton on CUDA, torch elsewhere. ``triton`` where Triton cannot run (no
    package, no GPU and not interpreting) raises TritonUnavailable: never a quiet fallback.
    ``native`` and ``prefill``: the CPU kernel modules the torch backend may use (or None)."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        from engine.triton_ops.common import (
            TritonUnavailable,
            triton_unavailable_reason,
        )

        reason = triton_unavailable_reason(device)
        if reason:
            raise TritonUnavailable(f"attention backend 'triton' cannot run on {device}: {reason}")
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(dtype, device)
    if device.type != "cpu":
        raise ValueError(f"the torch attention backend runs on the CPU; on {device} use triton (or auto)")
    from engine.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(dtype, native, prefill)
