"""Attention on the CPU with plain torch ops, reading K/V through block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, BatchLayout


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One prefill chunk: its queries attend to context slots [0, seq_len)."""

    query_start: int  # first flat token index of the chunk
    query_len: int
    context_slots: torch.Tensor  # [seq_len] int64 cache slots of positions 0 .. seq_len-1
    causal_mask: torch.Tensor | None  # [query_len, seq_len] bool (True = attend); None if no prefix


@dataclass(frozen=True, slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_slots: torch.Tensor  # [num_decodes, max_decode_len] int64 (padding points at slot 0)
    decode_valid: torch.Tensor  # [num_decodes, 1, 1, max_decode_len] bool
    prefills: tuple[PrefillSeq, ...]


def _context_slots(block_table: list[int], seq_len: int, block_size: int) -> torch.Tensor:
    # position p lives at slot block_table[p // block_size] * block_size + p % block_size
    positions = torch.arange(seq_len)
    blocks = torch.tensor(block_table, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


class TorchAttentionBackend(AttentionBackend):
    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        bs = layout.block_size
        n_dec = layout.num_decodes
        max_len = max(layout.seq_lens[:n_dec], default=0)
        decode_slots = torch.zeros((n_dec, max_len), dtype=torch.int64)
        decode_valid = torch.zeros((n_dec, max_len), dtype=torch.bool)
        for i in range(n_dec):
            seq_len = layout.seq_lens[i]
            decode_slots[i, :seq_len] = _context_slots(layout.block_tables[i], seq_len, bs)
            decode_valid[i, :seq_len] = True
        prefills = []
        start = n_dec
        for i in range(n_dec, len(layout.query_lens)):
            q_len, seq_len = layout.query_lens[i], layout.seq_lens[i]
            mask = None
            if seq_len != q_len:
                # query j sits at absolute position seq_len - q_len + j, sees keys <= it
                q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
                mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
            prefills.append(
                PrefillSeq(start, q_len, _context_slots(layout.block_tables[i], seq_len, bs), mask)
            )
            start += q_len
        return TorchAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_decodes=n_dec,
            decode_slots=decode_slots,
            decode_valid=decode_valid.view(n_dec, 1, 1, max_len),
            prefills=tuple(prefills),
        )

    def forward(self, query, key, value, key_cache, value_cache, metadata: TorchAttentionMetadata):
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        flat_k = key_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, kv_heads, head_dim]
        flat_v = value_cache.view(-1, num_kv_heads, head_dim)
        flat_k.index_copy_(0, metadata.slot_mapping, key)
        flat_v.index_copy_(0, metadata.slot_mapping, value)
        out = torch.empty_like(query)
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(query[: metadata.num_decodes], flat_k, flat_v, metadata)
        for seq in metadata.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            out[rows] = self._prefill(query[rows], flat_k, flat_v, seq)
        return out

    @staticmethod
    def _prefill(query, flat_k, flat_v, seq: PrefillSeq) -> torch.Tensor:
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
        k = flat_k[seq.context_slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, seq_len, head_dim]
        v = flat_v[seq.context_slots].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=seq.causal_mask,
            is_causal=seq.causal_mask is None,
            enable_gqa=True,
        )  # [1, heads, q_len, head_dim]
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def _decode(query, flat_k, flat_v, meta: TorchAttentionMetadata) -> torch.Tensor:
        n, num_heads, head_dim = query.shape
        num_kv_heads = flat_k.shape[1]
        group = num_heads // num_kv_heads
        k = flat_k[meta.decode_slots]  # [n, max_len, kv_heads, head_dim]
        v = flat_v[meta.decode_slots]
        q = query.view(n, num_kv_heads, group, head_dim)
        scores = torch.einsum("nkgd,nlkd->nkgl", q, k) * head_dim**-0.5  # [n, kv_heads, group, max_len]
        # Padding and stale slots may hold anything (NaN too): mask scores, zero values.
        scores = scores.masked_fill(~meta.decode_valid, float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        v = v.masked_fill(~meta.decode_valid.view(n, -1, 1, 1), 0.0)
        out = torch.einsum("nkgl,nlkd->nkgd", probs, v)  # [n, kv_heads, group, head_dim]
        return out.reshape(n, num_heads, head_dim)
