"""KV cache write: each new token's keys and values (one row of 2 * kv_heads * head_dim)
scattered into the cache slot its slot mapping names (slot = block * block_size + offset).
A negative slot skips the token (padding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_ops.common import (
    LAUNCHES,
    check_device,
    check_index,
    check_kv_cache,
    next_power_of_2,
)


@triton.jit
def _kv_write_kernel(cache_ptr, kv_ptr, slots_ptr, stride_kt, stride_cb, stride_cs,
                     BLOCK_SIZE: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    keep = offs < ROW
    row = tl.load(kv_ptr + token * stride_kt + offs, mask=keep)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    tl.store(dst + offs, row, mask=keep)


def write_kv(key_value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key_value [num_tokens, 2 * kv_heads, head_dim] (keys then values) into kv_cache
    [num_blocks, block_size, 2 * kv_heads, head_dim] at slot_mapping [num_tokens]."""
    num_blocks, block_size, num_kv_heads, head_dim = check_kv_cache(kv_cache)
    if key_value.dim() != 3 or key_value.shape[1:] != kv_cache.shape[2:]:
        raise ValueError(f"key_value must be [num_tokens, {2 * num_kv_heads}, {head_dim}], got "
                         f"{tuple(key_value.shape)}")
    if key_value.dtype != kv_cache.dtype:
        raise ValueError(f"key_value dtype {key_value.dtype} != kv_cache dtype {kv_cache.dtype}")
    if key_value.stride(2) != 1 or key_value.stride(1) != head_dim:
        raise ValueError("key_value must be contiguous within each token's row")
    check_index("slot_mapping", slot_mapping, 1)
    if slot_mapping.shape[0] != key_value.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {key_value.shape[0]} tokens")
    check_device(key_value, kv_cache, slot_mapping)
    if key_value.shape[0] == 0:
        return
    row = 2 * num_kv_heads * head_dim
    LAUNCHES["kv_write"] += 1
    _kv_write_kernel[(key_value.shape[0],)](kv_cache, key_value, slot_mapping, key_value.stride(0),
                                            kv_cache.stride(0), kv_cache.stride(1),
                                            BLOCK_SIZE=block_size, ROW=row, ROW_PAD=next_power_of_2(row))
