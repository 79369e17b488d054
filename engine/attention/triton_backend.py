"""Attention with the Triton kernels (engine/triton_ops): the GPU path's backend. On the CPU it
runs only interpreted (TRITON_INTERPRET=1), which is how the tests check it against the torch
backend without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionBackend, BatchLayout
from engine.kv_cache.kv_cache import padded_block_tables
from engine.triton_ops.kv_write import (
    write_kv,  # imports triton: this module loads only when chosen
)
from engine.triton_ops.paged_decode import paged_decode_attention
from engine.triton_ops.paged_prefill import paged_prefill_attention


@dataclass(frozen=True, slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens]
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, max_blocks] int32 (padding never read)
    decode_seq_lens: torch.Tensor  # [num_decodes] int32
    max_decode_len: int
    prefill_block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32
    prefill_cu_seqlens: torch.Tensor  # [num_prefills + 1] int32, from 0 (tokens after the decodes)
    max_prefill_len: int


def _table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    return padded_block_tables(rows, torch.int32, min_width=1).to(device)


class TritonAttentionBackend(AttentionBackend):
    """Decodes through paged_decode_attention (split-K chosen per step from the shapes),
    prefill chunks through paged_prefill_attention, K/V written by write_kv."""

    uses_triton = True

    def __init__(self, dtype: torch.dtype, device: torch.device | str = "cuda") -> None:
        self.dtype = dtype
        self.device = torch.device(device)

    def build_metadata(self, layout: BatchLayout) -> TritonAttentionMetadata:
        n_dec = layout.num_decodes
        seq_lens = layout.seq_lens
        cu = [0]
        for q_len in layout.query_lens[n_dec:]:
            cu.append(cu[-1] + q_len)
        to = self.device
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping.to(to),
            num_decodes=n_dec,
            decode_block_tables=_table(layout.block_tables[:n_dec], to),
            decode_seq_lens=torch.tensor(seq_lens[:n_dec], dtype=torch.int32, device=to),
            max_decode_len=max(seq_lens[:n_dec], default=0),
            prefill_block_tables=_table(layout.block_tables[n_dec:], to),
            prefill_seq_lens=torch.tensor(seq_lens[n_dec:], dtype=torch.int32, device=to),
            prefill_cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=to),
            max_prefill_len=max(layout.query_lens[n_dec:], default=0),
        )

    def decode_only_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             max_decode_len: int) -> TritonAttentionMetadata:
        """Metadata over tensors the caller owns and refills in place (engine/decode_graphs.py):
        every row decodes, no prefill. ``max_decode_len`` only chooses the split count."""
        empty = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
        return TritonAttentionMetadata(
            slot_mapping=slot_mapping, num_decodes=slot_mapping.shape[0], decode_block_tables=block_tables,
            decode_seq_lens=seq_lens, max_decode_len=max_decode_len, prefill_block_tables=empty,
            prefill_seq_lens=empty[:, 0], prefill_cu_seqlens=torch.zeros(1, dtype=torch.int32, device=self.device),
            max_prefill_len=0,
        )

    def forward(self, query, key_value, kv_cache, metadata: TritonAttentionMetadata):
        write_kv(key_value, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(query)
        n_dec = metadata.num_decodes
        scale = query.shape[-1] ** -0.5
        if n_dec:
            paged_decode_attention(query[:n_dec], kv_cache, metadata.decode_block_tables, metadata.decode_seq_lens,
                                   scale, out=out[:n_dec], max_seq_len=metadata.max_decode_len)
        if metadata.max_prefill_len:
            paged_prefill_attention(query[n_dec:], kv_cache, metadata.prefill_block_tables,
                                    metadata.prefill_seq_lens, metadata.prefill_cu_seqlens, metadata.max_prefill_len,
                                    scale, out=out[n_dec:])
        return out
