"""KV block pack/unpack for transfer: a request's blocks over a range of layers gathered into
one contiguous buffer [num_layers, num_blocks, block_size, 2 * kv_heads, head_dim], and
scattered back into another cache's blocks. The cache is one tensor over layers
[num_layers, num_cache_blocks, block_size, 2 * kv_heads, head_dim] (engine/kv_cache keeps its
layers as views of such a tensor), so one launch covers the whole layer range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_ops.common import LAUNCHES, check_device, check_index, check_kv_cache

CHUNK = 1024  # elements each program copies


@triton.jit
def _pack_kernel(buf_ptr, cache_ptr, ids_ptr, layer_start, num_ids, stride_cl, stride_cb,
                 BLOCK_ELEMS: tl.constexpr, CHUNK: tl.constexpr, UNPACK: tl.constexpr):
    i = tl.program_id(0)  # which of the request's blocks
    layer = tl.program_id(1)  # within the range
    chunk = tl.program_id(2)
    block = tl.load(ids_ptr + i).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    keep = offs < BLOCK_ELEMS
    cache = cache_ptr + (layer_start + layer).to(tl.int64) * stride_cl + block * stride_cb + offs
    buf = buf_ptr + (layer.to(tl.int64) * num_ids + i) * BLOCK_ELEMS + offs
    if UNPACK:
        tl.store(cache, tl.load(buf, mask=keep), mask=keep)
    else:
        tl.store(buf, tl.load(cache, mask=keep), mask=keep)


def _check(cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int) -> tuple[int, int]:
    if cache.dim() != 5:
        raise ValueError(f"cache must be [num_layers, num_blocks, block_size, 2 * kv_heads, head_dim], got shape "
                         f"{tuple(cache.shape)}")
    check_kv_cache(cache[0])
    if cache[0].stride(1) * cache.shape[2] != cache.stride(1) or not cache[0, 0].is_contiguous():
        raise ValueError("each cache block must be contiguous")
    check_index("block_ids", block_ids, 1)
    if not 0 <= layer_start < layer_end <= cache.shape[0]:
        raise ValueError(f"layer range [{layer_start}, {layer_end}) is not inside [0, {cache.shape[0]})")
    return cache[0, 0].numel(), layer_end - layer_start


def pack_kv_blocks(cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Blocks ``block_ids`` of layers [layer_start, layer_end) -> [layers, len(block_ids),
    block_size, 2 * kv_heads, head_dim], contiguous."""
    block_elems, layers = _check(cache, block_ids, layer_start, layer_end)
    shape = (layers, block_ids.shape[0], *cache.shape[2:])
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    elif tuple(out.shape) != shape or out.dtype != cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {shape} {cache.dtype}")
    check_device(cache, block_ids, out)
    _launch(out, cache, block_ids, layer_start, layers, block_elems, unpack=False)
    return out


def unpack_kv_blocks(buffer: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int) -> None:
    """The reverse of pack_kv_blocks: buffer [layers, len(block_ids), ...] into ``cache``'s
    blocks ``block_ids`` of layers [layer_start, layer_start + layers)."""
    if buffer.dim() != 5:
        raise ValueError(f"buffer must be [layers, blocks, block_size, 2 * kv_heads, head_dim], got "
                         f"{tuple(buffer.shape)}")
    block_elems, layers = _check(cache, block_ids, layer_start, layer_start + buffer.shape[0])
    shape = (layers, block_ids.shape[0], *cache.shape[2:])
    if tuple(buffer.shape) != shape or buffer.dtype != cache.dtype or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a contiguous {shape} {cache.dtype}, got {tuple(buffer.shape)} "
                         f"{buffer.dtype}")
    check_device(buffer, cache, block_ids)
    _launch(buffer, cache, block_ids, layer_start, layers, block_elems, unpack=True)


def _launch(buffer, cache, block_ids, layer_start: int, layers: int, block_elems: int, unpack: bool) -> None:
    if block_ids.shape[0] == 0:
        return
    LAUNCHES["kv_unpack" if unpack else "kv_pack"] += 1
    grid = (block_ids.shape[0], layers, triton.cdiv(block_elems, CHUNK))
    _pack_kernel[grid](buffer, cache, block_ids, layer_start, block_ids.shape[0], cache.stride(0), cache.stride(1),
                       BLOCK_ELEMS=block_elems, CHUNK=CHUNK, UNPACK=unpack)
