"""The KV tensors: per layer, one key and one value tensor of fixed-size blocks."""

from __future__ import annotations

import torch

from engine.config import CacheConfig, ModelArchConfig


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * element


def num_blocks_for(arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype) -> int:
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    return max(1, cache.kv_cache_memory_bytes // bytes_per_block(arch, cache.block_size, dtype))


class KVCache:
    """Holds ``layers[i]``: one tensor [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    per layer, keys in heads [0, num_kv_heads) and values in the rest, so that one index op
    writes or gathers both. Slot s = block * block_size + offset."""

    def __init__(self, arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype):
        shape = (num_blocks, block_size, 2 * arch.num_key_value_heads, arch.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = arch.num_key_value_heads
        self.layers = [torch.zeros(shape, dtype=dtype) for _ in range(arch.num_hidden_layers)]

    def fill_blocks(self, block_ids: list[int], value: float) -> None:
        """Overwrite whole blocks in every layer (tests poison discarded blocks with NaN)."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for layer in self.layers:
            layer[index] = value
