"""Attention on the CPU with plain torch ops, reading K/V through block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, BatchLayout
from engine.kv_cache.kv_cache import padded_block_tables, slot_indices


@dataclass(frozen=True, slots=True)
class PrefillSeq:
    """One prefill chunk: its queries attend to context positions [0, seq_len). The native
    kernel reads them through ``block_table``; SDPA through ``context_slots`` and the mask."""

    query_start: int  # first flat token index of the chunk
    query_len: int
    seq_len: int  # context length after this chunk (its own tokens included)
    block_table: torch.Tensor | None  # [ceil(seq_len / block_size)] int64 block ids; None: SDPA
    context_slots: torch.Tensor | None  # [seq_len] int64 cache slots of positions 0 .. seq_len-1; None: native
    causal_mask: torch.Tensor | None  # [query_len, seq_len] bool (True = attend); None if no prefix or native


@dataclass(frozen=True, slots=True)
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64
    decode_padding: torch.Tensor  # [num_decodes, max_blocks * block_size, 1, 1] bool, True = not context
    decode_mask: torch.Tensor  # [num_decodes, 1, 1, max_blocks * block_size] additive: 0 or -inf
    prefills: tuple[PrefillSeq, ...]


class TorchAttentionBackend(AttentionBackend):
    """Attention on the CPU. ``dtype``: the model's, for masks built once per step.
    ``native``: the cpu_ops module (engine/kernels), or None for torch ops only.
    ``prefill``: the prefill_attention module (bfloat16, AVX-512 BF16 CPUs), or None.

    Decodes: with ``native``, one call reads each sequence's K/V through its block table
    (only positions before its end). Without it, each sequence's blocks are gathered whole
    (one index_select per layer), the slots past its end zeroed and masked, and one batched
    SDPA call does the rest. Prefill chunks: with ``prefill``, one call per chunk reads its
    context through the block table; without it, the context is gathered slot by slot, then
    SDPA with a causal (offset) mask."""

    def __init__(self, dtype: torch.dtype = torch.float32, native=None, prefill=None) -> None:
        self.dtype = dtype
        self.native = native
        self.prefill = prefill  # engine/kernels/prefill_attention.for_model chose it for this dtype

    def build_metadata(self, layout: BatchLayout) -> TorchAttentionMetadata:
        bs = layout.block_size
        n_dec = layout.num_decodes
        block_ids = padded_block_tables(layout.block_tables[:n_dec], torch.int64)
        max_blocks = block_ids.shape[1]
        seq_lens = torch.tensor(layout.seq_lens[:n_dec], dtype=torch.int64)
        # torch path only: which gathered slots are context ([n_dec, max_blocks * bs])
        gathered = max_blocks * bs if self.native is None else 0
        attend = torch.arange(gathered).unsqueeze(0) < seq_lens.unsqueeze(1)
        prefills = []
        start = n_dec
        for i in range(n_dec, len(layout.query_lens)):
            q_len, seq_len = layout.query_lens[i], layout.seq_lens[i]
            table, slots, mask = None, None, None
            if self.prefill is not None:
                table = torch.tensor(layout.block_tables[i][: -(-seq_len // bs)], dtype=torch.int64)
            else:
                slots = slot_indices(layout.block_tables[i], 0, seq_len, bs)
                if seq_len != q_len:
                    # query j sits at absolute position seq_len - q_len + j, sees keys <= it
                    q_pos = torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
                    mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
            prefills.append(PrefillSeq(start, q_len, seq_len, table, slots, mask))
            start += q_len
        return TorchAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            num_decodes=n_dec,
            decode_block_tables=block_ids,
            decode_seq_lens=seq_lens,
            decode_padding=(~attend).view(n_dec, gathered, 1, 1),
            decode_mask=torch.zeros(attend.shape, dtype=self.dtype)
            .masked_fill_(~attend, float("-inf"))
            .view(n_dec, 1, 1, gathered),
            prefills=tuple(prefills),
        )

    def forward(self, query, key_value, kv_cache, metadata: TorchAttentionMetadata):
        num_kv_heads = key_value.shape[1] // 2
        head_dim = key_value.shape[2]
        flat = kv_cache.view(-1, 2 * num_kv_heads, head_dim)  # [num_slots, 2 * kv_heads, head_dim]
        flat.index_copy_(0, metadata.slot_mapping, key_value)
        if not metadata.prefills:
            return self._decode(query, kv_cache, metadata)
        out = torch.empty_like(query)
        if metadata.num_decodes:
            out[: metadata.num_decodes] = self._decode(query[: metadata.num_decodes], kv_cache, metadata)
        for seq in metadata.prefills:
            rows = slice(seq.query_start, seq.query_start + seq.query_len)
            if seq.context_slots is None:
                out[rows] = self.prefill.paged_prefill_attention(query[rows], kv_cache, seq.block_table, seq.seq_len,
                                                                 head_dim**-0.5)
            else:
                out[rows] = self._prefill(query[rows], flat, seq)
        return out

    @staticmethod
    def _prefill(query, flat, seq: PrefillSeq) -> torch.Tensor:
        num_kv_heads = flat.shape[1] // 2
        context = flat.index_select(0, seq.context_slots).transpose(0, 1)  # [2 * kv_heads, seq_len, head_dim]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),  # [1, heads, q_len, head_dim]
            context[:num_kv_heads].unsqueeze(0),  # [1, kv_heads, seq_len, head_dim]
            context[num_kv_heads:].unsqueeze(0),
            attn_mask=seq.causal_mask,
            is_causal=seq.causal_mask is None,
            enable_gqa=True,
        )  # [1, heads, q_len, head_dim]
        return out.squeeze(0).transpose(0, 1)

    def _decode(self, query, kv_cache, meta: TorchAttentionMetadata) -> torch.Tensor:
        n, num_heads, head_dim = query.shape
        if self.native is not None:
            return self.native.paged_decode_attention(
                query, kv_cache, meta.decode_block_tables, meta.decode_seq_lens, head_dim**-0.5
            )
        num_kv_heads = kv_cache.shape[2] // 2
        # whole blocks: [n, max_blocks * block_size, 2 * kv_heads, head_dim]
        blocks = kv_cache.index_select(0, meta.decode_block_tables.view(-1)).view(n, -1, 2 * num_kv_heads, head_dim)
        # slots past a sequence's end hold anything (NaN too): zero them, then mask them
        blocks.masked_fill_(meta.decode_padding, 0.0)
        context = blocks.transpose(1, 2)  # [n, 2 * kv_heads, len, head_dim]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [n, heads, 1, head_dim]
            context[:, :num_kv_heads],
            context[:, num_kv_heads:],
            attn_mask=meta.decode_mask,
            enable_gqa=True,
        )  # [n, heads, 1, head_dim]
        return out.view(n, num_heads, head_dim)
