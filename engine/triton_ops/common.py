"""What the kernels share: can Triton run here, launch counting, and the checks every launcher
makes on its tensors."""

from __future__ import annotations

import os
from collections import Counter

import torch

LAUNCHES: Counter[str] = Counter()  # kernel name -> launches (tests: proof that a kernel ran)

# dtypes the kernels take for attention inputs and the KV cache
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TritonUnavailable(RuntimeError):
    """Triton was asked for where it cannot run (never a silent fallback to torch)."""


def interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs kernels on CPU tensors with numpy (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device | str) -> str | None:
    """None when Triton kernels can run on ``device``; otherwise why not."""
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"the triton package is not installed ({exc})"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available"
    if device.type == "cpu":
        return None if interpreting() else (
            "Triton kernels need a CUDA device; on the CPU they run only interpreted (TRITON_INTERPRET=1, "
            "for tests), so use the torch attention backend here")
    return f"Triton kernels do not run on {device.type}"


def check_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors on different devices: {sorted(str(d) for d in devices)}")
    reason = triton_unavailable_reason(next(iter(devices)))
    if reason:
        raise TritonUnavailable(reason)


def check_index(name: str, tensor: torch.Tensor, dims: int) -> None:
    if tensor.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    if tensor.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimension(s), got shape {tuple(tensor.shape)}")
    if tensor.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension")


def check_kv_cache(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """[num_blocks, block_size, 2 * num_kv_heads, head_dim], rows contiguous -> its four sizes."""
    if kv_cache.dim() != 4:
        raise ValueError(f"kv_cache must be [num_blocks, block_size, 2 * kv_heads, head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"kv_cache dtype {kv_cache.dtype} is not one of {SUPPORTED_DTYPES}")
    num_blocks, block_size, two_kv_heads, head_dim = kv_cache.shape
    if two_kv_heads % 2:
        raise ValueError(f"kv_cache's third dimension must be 2 * kv_heads, got {two_kv_heads}")
    if kv_cache.stride(3) != 1 or kv_cache.stride(2) != head_dim:
        raise ValueError("kv_cache must be contiguous within each slot (heads x head_dim)")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 for the Triton kernels, got {block_size}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Triton kernels, got {head_dim}")
    return num_blocks, block_size, two_kv_heads // 2, head_dim


def check_attention(query: torch.Tensor, kv_cache: torch.Tensor, rows: str) -> tuple[int, int, int, int, int]:
    """query [rows, num_heads, head_dim] against kv_cache -> (rows, num_heads, head_dim,
    block_size, num_kv_heads)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [{rows}, num_heads, head_dim], got shape {tuple(query.shape)}")
    num_rows, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = check_kv_cache(kv_cache)
    if cache_head_dim != head_dim:
        raise ValueError(f"query head_dim {head_dim} != kv_cache head_dim {cache_head_dim}")
    if query.dtype != kv_cache.dtype or query.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"query ({query.dtype}) and kv_cache ({kv_cache.dtype}) must share a supported dtype")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(2) != 1:
        raise ValueError("query must be contiguous in head_dim")
    return num_rows, num_heads, head_dim, block_size, num_kv_heads


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` checked against ``query`` (same shape and dtype, contiguous rows), or a new one."""
    if out is None:
        return torch.empty_like(query)
    if out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must match query: {tuple(query.shape)} {query.dtype}, contiguous in head_dim")
    return out


def dot_mode(dtype: torch.dtype) -> tuple[bool, str]:
    """(upcast, input_precision) for tl.dot on tiles of ``dtype``.

    float32 uses IEEE products (TF32 would cost accuracy the engine's equality rule notices).
    bfloat16 is upcast to float32 first when interpreting: Triton's interpreter returns garbage
    for bf16 x bf16 dots (3.6 and 3.9, measured), and bf16 values are exact in float32. On a GPU,
    16-bit tiles go to the tensor cores as they are."""
    if dtype == torch.float32:
        return False, "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return True, "ieee"
    return False, "tf32"  # ignored for 16-bit inputs


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
