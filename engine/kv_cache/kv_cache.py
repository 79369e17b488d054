"""The KV tensors: per layer, one key and one value tensor of fixed-size blocks."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import PROMPT_LOGPROBS_ROWS, CacheConfig, ModelArchConfig


def bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * arch.num_hidden_layers * block_size * arch.num_key_value_heads * arch.head_dim * element


CPU_KV_CACHE_BYTES = 1 << 30  # the budget on the CPU when none is given


def num_blocks_for(arch: ModelArchConfig, cache: CacheConfig, dtype: torch.dtype,
                   gpu_budget: Callable[[], int] | None = None) -> int:
    """The pool size: ``num_kv_blocks`` if given, else the memory budget over one block's bytes.
    The budget: ``kv_cache_memory_bytes`` if given, else on a GPU what ``gpu_budget()`` measures
    (called only then), else 1 GiB."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        budget = gpu_budget() if gpu_budget is not None else CPU_KV_CACHE_BYTES
    return max(1, budget // bytes_per_block(arch, cache.block_size, dtype))


def activation_headroom(arch: ModelArchConfig, max_num_batched_tokens: int, max_num_seqs: int,
                        dtype: torch.dtype) -> int:
    """What one step may hold beyond the weights and the KV cache, generously: per batched token
    the residual, the normed input, Q/K/V, the attention output and the MLP's gate, up and
    product, twice over for temporaries; plus float32 logits and their softmax for every
    sequence sampled, or for one slice of prompt positions scored for prompt logprobs."""
    element = torch.tensor([], dtype=dtype).element_size()
    qkv = (arch.num_attention_heads + 2 * arch.num_key_value_heads) * arch.head_dim
    per_token = 2 * element * (3 * arch.hidden_size + qkv + 3 * arch.intermediate_size)
    logit_rows = max(max_num_seqs, PROMPT_LOGPROBS_ROWS)
    return max_num_batched_tokens * per_token + 2 * 4 * logit_rows * arch.vocab_size


def gpu_kv_budget(total_bytes: int, free_bytes: int, utilization: float, headroom_bytes: int) -> int:
    """KV cache bytes on a GPU (vLLM's gpu_memory_utilization): this worker may bring the
    device to ``utilization`` of its memory. What is in use now (its weights, other processes)
    and the step's activation headroom come off; the rest is the KV cache."""
    in_use = total_bytes - free_bytes
    budget = int(utilization * total_bytes) - in_use - headroom_bytes
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total_bytes / gib:.1f} GiB allowed, "
            f"{in_use / gib:.1f} GiB in use (weights and other processes), {headroom_bytes / gib:.1f} GiB kept "
            "for activations; raise gpu_memory_utilization, lower max_num_batched_tokens, or set num_kv_blocks"
        )
    return budget


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The flat cache slot of one position (a decode's): plain ints, no tensor."""
    return block_table[position // block_size] * block_size + position % block_size


def padded_block_tables(tables: list[list[int]], dtype: torch.dtype, min_width: int = 0) -> torch.Tensor:
    """[len(tables), width] block tables in one tensor, each row padded with block 0 (never
    read: attention stops at each sequence's length); width = the longest, at least min_width."""
    width = max(max((len(t) for t in tables), default=0), min_width)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=dtype).reshape(len(tables), width)


def slot_indices(block_table: list[int], start_pos: int, end_pos: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [start_pos, end_pos) through a block table.

    position p lives at slot block_table[p // block_size] * block_size + p % block_size
    -> [end_pos - start_pos] int64
    """
    positions = torch.arange(start_pos, end_pos)
    blocks = torch.tensor(block_table, dtype=torch.int64)[positions // block_size]
    return blocks * block_size + positions % block_size


class KVCache:
    """Holds ``layers[i]``: one tensor [num_blocks, block_size, 2 * num_kv_heads, head_dim]
    per layer, keys in heads [0, num_kv_heads) and values in the rest, so that one index op
    writes or gathers both. Slot s = block * block_size + offset. The layers are views of one
    tensor ``storage`` [num_layers, num_blocks, ...], so a kernel can cover a layer range in
    one launch (pack_blocks / unpack_blocks)."""

    def __init__(self, arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", triton: bool = False):
        shape = (arch.num_hidden_layers, num_blocks, block_size, 2 * arch.num_key_value_heads, arch.head_dim)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.storage = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = list(self.storage.unbind(0))
        self.triton = triton  # pack/unpack with the Triton kernels (the engine sets it with the Triton backend)

    def pack_blocks(self, block_ids: list[int], layer_start: int, layer_end: int) -> torch.Tensor:
        """Blocks ``block_ids`` of layers [layer_start, layer_end), contiguous:
        [layers, len(block_ids), block_size, 2 * kv_heads, head_dim], in one launch."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.storage.device)
        if self.triton:
            from engine.triton_ops.kv_pack import pack_kv_blocks

            return pack_kv_blocks(self.storage, index, layer_start, layer_end)
        if not 0 <= layer_start < layer_end <= self.storage.shape[0]:
            raise ValueError(f"layers [{layer_start}, {layer_end}) outside [0, {self.storage.shape[0]})")
        return self.storage[layer_start:layer_end].index_select(1, index)

    def unpack_blocks(self, buffer: torch.Tensor, block_ids: list[int], layer_start: int) -> None:
        """The reverse of pack_blocks, into this cache's blocks ``block_ids``."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.storage.device)
        layers = self.storage[layer_start:layer_start + buffer.shape[0]]
        if buffer.shape != (layers.shape[0], len(block_ids), *layers.shape[2:]) or buffer.dtype != layers.dtype:
            raise ValueError(f"a buffer of {tuple(buffer.shape)} {buffer.dtype} does not fit {len(block_ids)} blocks "
                             f"of layers from {layer_start}")
        if self.triton:
            from engine.triton_ops.kv_pack import unpack_kv_blocks

            unpack_kv_blocks(buffer.to(self.storage.device).contiguous(), self.storage, index, layer_start)
            return
        layers.index_copy_(1, index, buffer)

    def fill_blocks(self, block_ids: list[int], value: float) -> None:
        """Overwrite whole blocks in every layer (tests poison discarded blocks with NaN)."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for layer in self.layers:
            layer[index] = value

    def slots_for(self, block_table: list[int], start_pos: int, end_pos: int) -> torch.Tensor:
        return slot_indices(block_table, start_pos, end_pos, self.block_size)

    def read_slots(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the K/V at ``slots``: [len(slots), 2 * kv_heads, head_dim]."""
        flat = self.layers[layer].flatten(0, 1)
        return flat.index_select(0, slots.to(flat.device))

    def write_slots(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        flat = self.layers[layer].flatten(0, 1)
        if kv.shape != (len(slots), *flat.shape[1:]) or kv.dtype != flat.dtype:
            raise ValueError(
                f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit {len(slots)} slots of "
                f"{tuple(flat.shape[1:])} {flat.dtype}"
            )
        flat.index_copy_(0, slots.to(flat.device), kv.to(flat.device))
