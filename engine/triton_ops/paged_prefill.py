"""Chunked-prefill attention over paged KV: each sequence's chunk of new tokens attends causally
to itself and to the sequence's cached prefix, all read through its block table (the chunk's
own K/V is written to the cache first, by kv_write). Variable-length batch: sequence i's
queries are rows [cu_seqlens_q[i], cu_seqlens_q[i + 1]) of the flat query.

One program serves BLOCK_M queries of one sequence and one query head; it walks the context
TILE tokens at a time up to its last query's position (causal), with an online softmax in
float32. Query j of a chunk of q_len in a context of seq_len sits at position
seq_len - q_len + j and sees positions <= its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.triton_ops.common import (
    LAUNCHES,
    check_attention,
    check_device,
    check_index,
    dot_mode,
    output_like,
)
from engine.triton_ops.paged_decode import (
    LOG2E,
    TILE_TOKENS,
    load_kv_tile,
    softmax_step,
)


@triton.jit
def _prefill_kernel(out_ptr, query_ptr, cache_ptr, tables_ptr, seq_lens_ptr, cu_q_ptr, qk_scale,
                    stride_ot, stride_oh, stride_qt, stride_qh, stride_ts, stride_cb, stride_cs, stride_ch,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    m_block, head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # grid: query blocks, heads, seqs
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kv_head = head // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, TILE)
    row_ok = offs_m < q_len
    q = tl.load(query_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    q = q.to(tl.float32) * qk_scale
    if not UPCAST:
        q = q.to(query_ptr.dtype.element_ty)
    q_pos = prefix + offs_m
    table = tables_ptr + seq * stride_ts
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    last = tl.minimum(prefix + (m_block + 1) * BLOCK_M, seq_len)  # keys past the tile's last query: unseen
    for tile in range(0, tl.cdiv(last, TILE)):
        pos = tile * TILE + offs_t
        valid = pos < last
        k, v = load_kv_tile(cache_ptr, table, pos, valid, kv_head, stride_cb, stride_cs, stride_ch,
                            NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, UPCAST)
        m_i, l_i, acc = softmax_step(q, k, v, valid[None, :] & (pos[None, :] <= q_pos[:, None]), m_i, l_i, acc,
                                     PRECISION)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, max_query_len: int,
                            scale: float | None = None, out: torch.Tensor | None = None,
                            block_m: int | None = None) -> torch.Tensor:
    """query [num_tokens, num_heads, head_dim] (the chunks, back to back); cu_seqlens_q
    [num_seqs + 1] (chunk boundaries, starting at 0); seq_lens [num_seqs] (context after this
    step, the chunk included); block_tables [num_seqs, max_blocks]; ``max_query_len`` sizes the
    grid. Returns (or fills ``out``) [num_tokens, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim, block_size, num_kv_heads = check_attention(query, kv_cache, "num_tokens")
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    check_index("cu_seqlens_q", cu_seqlens_q, 1)
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"need one block-table row per sequence ({num_seqs}) and num_seqs + 1 cu_seqlens_q, got "
                         f"{block_tables.shape[0]} and {cu_seqlens_q.shape[0]}")
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    out = output_like(query, out)
    check_device(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out)
    if num_seqs == 0 or num_tokens == 0 or max_query_len == 0:
        return out
    upcast, precision = dot_mode(query.dtype)
    if block_m is None:
        block_m = 16 if query.device.type != "cuda" else (64 if head_dim <= 64 else 32)
    tile = max(TILE_TOKENS if query.device.type == "cuda" else 32, block_size)
    qk_scale = (scale if scale is not None else head_dim ** -0.5) * LOG2E
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    LAUNCHES["paged_prefill"] += 1
    _prefill_kernel[grid](out, query, kv_cache, block_tables, seq_lens, cu_seqlens_q, qk_scale,
                          out.stride(0), out.stride(1), query.stride(0), query.stride(1), block_tables.stride(0),
                          kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                          NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size,
                          BLOCK_M=block_m, TILE=tile, HEAD_DIM=head_dim, UPCAST=upcast, PRECISION=precision)
    return out
