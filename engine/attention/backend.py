"""The attention backend interface: how the model reads and writes the paged KV cache."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """Where each sequence's new tokens sit in the flattened batch and in the cache.

    The runner orders sequences decodes first (query_len == 1), then prefill chunks, so
    that tokens [0, num_decodes) are the decode group. For sequence i:

        context positions   0 ............ start_pos ........ seq_len - 1
                            |  cached KV  |  new tokens (query_len)   |
        flat tokens                        query_start_loc[i] .. query_start_loc[i+1]
    """

    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_tables: list[list[int]]  # per sequence: block ids covering positions [0, seq_len)
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot receiving each new token
    num_decodes: int  # leading sequences with query_len == 1
    block_size: int


class AttentionBackend(ABC):
    """Computes attention for a flattened batch against a paged KV cache.

    Contract: ``build_metadata`` is called by the model runner once per step (it may build
    index tensors, it must not touch the cache); ``forward`` is called by each attention
    layer of the model, on the engine thread, and blocks until the result is ready. Forward
    first writes the new tokens' K/V into the cache at ``slot_mapping``, then lets each new
    query attend causally to its sequence's whole context, read through the block table only.
    A backend never allocates or frees blocks; positions outside a sequence's context (the
    tail of its last block, other sequences' blocks) may hold anything, NaN included, and must
    not influence the result.
    """

    uses_triton = False  # the KV cache moves its blocks with the Triton kernels too (pack/unpack)

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> object:
        """Per-step, layer-independent state for ``forward``."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key_value: torch.Tensor,  # [num_tokens, 2 * num_kv_heads, head_dim]: keys, then values
        kv_cache: torch.Tensor,  # [num_blocks, block_size, 2 * num_kv_heads, head_dim]
        metadata: object,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write K/V of the new tokens, return attention output for them."""
