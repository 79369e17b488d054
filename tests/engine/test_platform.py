"""The `auto` dtype follows the measured matmul speed."""

from __future__ import annotations

import pytest
import torch

from engine import platform


def test_auto_dtype_follows_measurement(monkeypatch):
    platform.auto_dtype.cache_clear()
    speeds = {torch.float32: 1.0, torch.bfloat16: 0.5}
    monkeypatch.setattr(platform, "_time_linear", lambda dtype, *a: speeds[dtype])
    assert platform.auto_dtype("cpu", 64, 128) is torch.bfloat16
    platform.auto_dtype.cache_clear()
    speeds[torch.bfloat16] = 0.95  # under 10% faster: not worth the precision
    assert platform.auto_dtype("cpu", 64, 128) is torch.float32
    assert platform.auto_dtype("cuda", 64, 128) is torch.bfloat16
    platform.auto_dtype.cache_clear()



GIB = 1 << 30


def test_the_kv_cache_takes_what_gpu_memory_utilization_leaves():
    from engine.kv_cache.kv_cache import gpu_kv_budget

    # 80 GiB device, 6 GiB in use (weights, other processes), 2 GiB headroom: 0.9 * 80 - 6 - 2
    assert gpu_kv_budget(80 * GIB, 74 * GIB, 0.9, 2 * GIB) == int(0.9 * 80 * GIB) - 8 * GIB
    assert gpu_kv_budget(80 * GIB, 74 * GIB, 0.5, 2 * GIB) == 32 * GIB
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        gpu_kv_budget(80 * GIB, 10 * GIB, 0.9, 2 * GIB)  # another process holds 70 GiB


def test_the_kv_budget_precedence_and_the_activation_headroom(smollm_dir):
    from engine.config import CacheConfig
    from engine.kv_cache.kv_cache import activation_headroom, bytes_per_block, num_blocks_for
    from engine.model_info import load_model_info

    arch = load_model_info(str(smollm_dir)).arch
    block = bytes_per_block(arch, 16, torch.bfloat16)
    assert block == 2 * 30 * 16 * 3 * 64 * 2  # K and V, 30 layers, 16 tokens, 3 KV heads of 64, 2 bytes
    def unmeasured():
        raise AssertionError("the GPU is measured only when nothing else sets the budget")

    assert num_blocks_for(arch, CacheConfig(num_kv_blocks=7), torch.bfloat16, unmeasured) == 7
    assert num_blocks_for(arch, CacheConfig(kv_cache_memory_bytes=block * 5), torch.bfloat16, unmeasured) == 5
    assert num_blocks_for(arch, CacheConfig(), torch.bfloat16, lambda: block * 9 + 1) == 9  # the GPU's budget
    assert num_blocks_for(arch, CacheConfig(), torch.bfloat16) == GIB // block  # 1 GiB on the CPU
    logits = activation_headroom(arch, 0, 0, torch.bfloat16)
    # float32 logits and softmax for 256 rows: a slice of prompt positions scored for prompt logprobs
    assert logits == 256 * 2 * 4 * arch.vocab_size
    one = activation_headroom(arch, 1, 0, torch.bfloat16) - logits
    # per token: residual, normed input and attention output (3 x 576), Q/K/V (9 + 2 x 3 heads of 64),
    # the MLP's gate, up and product (3 x 1536), in bf16, twice over
    assert one == 2 * 2 * (3 * 576 + 15 * 64 + 3 * 1536)
    assert activation_headroom(arch, 8192, 64, torch.bfloat16) == 8192 * one + 256 * 2 * 4 * arch.vocab_size
    assert activation_headroom(arch, 8192, 512, torch.bfloat16) == 8192 * one + 512 * 2 * 4 * arch.vocab_size
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=1.5)


def test_the_engine_sizes_its_gpu_kv_cache_from_the_device_memory(monkeypatch, llm):
    core = llm.engine_core
    asked = []

    def mem_get_info(device):
        asked.append(device)
        return 30 * GIB, 40 * GIB  # free, total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    from engine.kv_cache.kv_cache import activation_headroom

    config = core.config
    headroom = activation_headroom(config.model.arch, config.scheduler.max_num_batched_tokens,
                                   config.scheduler.max_num_seqs, config.model.dtype)
    assert core._gpu_kv_budget(torch.device("cuda")) == int(0.9 * 40 * GIB) - 10 * GIB - headroom
    assert asked == [torch.device("cuda")]
