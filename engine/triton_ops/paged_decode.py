"""Paged decode attention: one query token per sequence against its K/V, read through its
block table.

One program serves one (sequence, KV head) and all the query heads that share that KV head
(grouped-query attention inside the kernel): their queries form the rows of a tile padded to
16 (the smallest tl.dot), so each K/V tile is loaded once per group, not once per query head.
The context is walked TILE tokens at a time (several blocks per step, their ids gathered from
the block table), with an online softmax in float32.

Split-K (flash-decoding): with ``num_splits`` > 1, each (sequence, KV head) is cut into that
many ranges of tiles handled by separate programs, which write their unnormalised partial
output, running max and running sum; a second kernel merges them. It pays off when the batch
alone does not give the GPU enough programs (few sequences, long contexts).
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
    next_power_of_2,
    output_like,
)

LOG2E = 1.4426950408889634
TILE_TOKENS = 64  # context positions per loop step (whole blocks)


@triton.jit
def load_kv_tile(cache_ptr, table_ptr, pos, valid, kv_head, stride_cb, stride_cs, stride_ch,
                 NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr):
    """Keys and values [len(pos), HEAD_DIM] of context positions ``pos``, found through the
    block table; positions not ``valid`` read as 0 and touch no memory."""
    offs_d = tl.arange(0, HEAD_DIM)
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs
    k = tl.load(cache_ptr + slot[:, None] + kv_head * stride_ch + offs_d[None, :], mask=valid[:, None], other=0.0)
    v = tl.load(cache_ptr + slot[:, None] + (NUM_KV_HEADS + kv_head) * stride_ch + offs_d[None, :],
                mask=valid[:, None], other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def softmax_step(q, k, v, keep, m_i, l_i, acc, PRECISION: tl.constexpr):
    """One tile of online softmax in log2 units (q carries scale * log2 e): scores where
    ``keep``, then the running max, sum and output updated. A row that has seen nothing keeps
    max -inf and sum 0."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_range(q, cache_ptr, table_ptr, seq_len, kv_head, tile_start, tile_end,
                  stride_cb, stride_cs, stride_ch,
                  NUM_KV_HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, UPCAST: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Online softmax of the query rows ``q`` [GROUP_PAD, HEAD_DIM] over context tiles
    [tile_start, tile_end): (acc, running max, running sum)."""
    offs_t = tl.arange(0, TILE)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for tile in range(tile_start, tile_end):
        pos = tile * TILE + offs_t
        valid = pos < seq_len
        k, v = load_kv_tile(cache_ptr, table_ptr, pos, valid, kv_head, stride_cb, stride_cs, stride_ch,
                            NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, UPCAST)
        m_i, l_i, acc = softmax_step(q, k, v, valid[None, :], m_i, l_i, acc, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _load_group_queries(query_ptr, seq, kv_head, qk_scale, stride_qs, stride_qh,
                        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                        UPCAST: tl.constexpr):
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    q = tl.load(query_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=(offs_g < GROUP)[:, None], other=0.0)
    q = (q.to(tl.float32) * qk_scale)
    if not UPCAST:
        q = q.to(query_ptr.dtype.element_ty)
    return q


@triton.jit
def _decode_kernel(out_ptr, query_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qk_scale,
                   stride_os, stride_oh, stride_qs, stride_qh, stride_ts, stride_cb, stride_cs, stride_ch,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, HEAD_DIM: tl.constexpr,
                   UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    q = _load_group_queries(query_ptr, seq, kv_head, qk_scale, stride_qs, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
                            UPCAST)
    acc, m_i, l_i = _attend_range(q, cache_ptr, tables_ptr + seq * stride_ts, seq_len, kv_head,
                                  0, tl.cdiv(seq_len, TILE), stride_cb, stride_cs, stride_ch,
                                  NUM_KV_HEADS, BLOCK_SIZE, TILE, HEAD_DIM, GROUP_PAD, UPCAST, PRECISION)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_g
    out = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(offs_g < GROUP)[:, None])


@triton.jit
def _decode_split_kernel(part_acc_ptr, part_ml_ptr, query_ptr, cache_ptr, tables_ptr, seq_lens_ptr, qk_scale,
                         stride_qs, stride_qh, stride_ts, stride_cb, stride_cs, stride_ch,
                         NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """Partials: acc [seqs, heads, splits, head_dim], (max, sum) [seqs, heads, splits, 2], float32."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_tiles = tl.cdiv(seq_len, TILE)
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, num_tiles)
    q = _load_group_queries(query_ptr, seq, kv_head, qk_scale, stride_qs, stride_qh, GROUP, GROUP_PAD, HEAD_DIM,
                            UPCAST)
    acc, m_i, l_i = _attend_range(q, cache_ptr, tables_ptr + seq * stride_ts, seq_len, kv_head,
                                  start, end, stride_cb, stride_cs, stride_ch,
                                  NUM_KV_HEADS, BLOCK_SIZE, TILE, HEAD_DIM, GROUP_PAD, UPCAST, PRECISION)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (seq * NUM_HEADS + kv_head * GROUP + offs_g) * NUM_SPLITS + split  # [GROUP_PAD]
    keep = offs_g < GROUP
    tl.store(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=keep[:, None])
    tl.store(part_ml_ptr + rows * 2, m_i, mask=keep)
    tl.store(part_ml_ptr + rows * 2 + 1, l_i, mask=keep)


@triton.jit
def _decode_reduce_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_os, stride_oh,
                          NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                          HEAD_DIM: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits of one (seq, head).
    An empty split has m = -inf and contributes nothing."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    keep = offs_s < NUM_SPLITS
    m = tl.load(part_ml_ptr + rows * 2, mask=keep, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + rows * 2 + 1, mask=keep, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp2(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=keep[:, None], other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context when the batch gives fewer than ~2 programs per SM and contexts are
    long enough (>= 2 tiles per split); a power of two, at most 32. 1 off CUDA."""
    if device.type != "cuda":
        return 1
    programs = num_seqs * num_kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    splits = 1
    while programs * splits < target and splits < 32 and max_seq_len >= 2 * TILE_TOKENS * splits * 2:
        splits *= 2
    return splits


def paged_decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float | None = None, out: torch.Tensor | None = None,
                           num_splits: int | None = None, max_seq_len: int | None = None) -> torch.Tensor:
    """query [num_seqs, num_heads, head_dim]; kv_cache [num_blocks, block_size, 2 * kv_heads,
    head_dim] (keys in heads [0, kv_heads), values after); block_tables [num_seqs, max_blocks]
    (entries past a sequence's blocks are never read); seq_lens [num_seqs] (each >= 1, the
    query's own position included). Returns (or fills ``out``) [num_seqs, num_heads, head_dim].
    ``num_splits``: 1 = single pass, > 1 = split-K, None = chosen from the shapes."""
    num_seqs, num_heads, head_dim, block_size, num_kv_heads = check_attention(query, kv_cache, "num_seqs")
    check_index("block_tables", block_tables, 2)
    check_index("seq_lens", seq_lens, 1)
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(f"block_tables ({block_tables.shape[0]}) and seq_lens ({seq_lens.shape[0]}) need one row "
                         f"per sequence ({num_seqs})")
    out = output_like(query, out)
    check_device(query, kv_cache, block_tables, seq_lens, out)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = max(16, next_power_of_2(group))
    upcast, precision = dot_mode(query.dtype)
    qk_scale = (scale if scale is not None else head_dim ** -0.5) * LOG2E
    tile = max(TILE_TOKENS, block_size)
    if num_splits is None:
        longest = max_seq_len if max_seq_len is not None else block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, longest, query.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    common = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, BLOCK_SIZE=block_size, TILE=tile,
                  HEAD_DIM=head_dim, UPCAST=upcast, PRECISION=precision)
    strides = (query.stride(0), query.stride(1), block_tables.stride(0), kv_cache.stride(0), kv_cache.stride(1),
               kv_cache.stride(2))
    if num_splits == 1:
        LAUNCHES["paged_decode"] += 1
        _decode_kernel[(num_seqs, num_kv_heads)](out, query, kv_cache, block_tables, seq_lens, qk_scale,
                                                 out.stride(0), out.stride(1), *strides, **common)
        return out
    part_acc = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((num_seqs, num_heads, num_splits, 2), dtype=torch.float32, device=query.device)
    LAUNCHES["paged_decode_split"] += 1
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        part_acc, part_ml, query, kv_cache, block_tables, seq_lens, qk_scale, *strides,
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, **common)
    LAUNCHES["paged_decode_reduce"] += 1
    _decode_reduce_kernel[(num_seqs, num_heads)](out, part_acc, part_ml, out.stride(0), out.stride(1),
                                                 NUM_HEADS=num_heads, NUM_SPLITS=num_splits,
                                                 SPLITS_PAD=next_power_of_2(num_splits), HEAD_DIM=head_dim)
    return out
