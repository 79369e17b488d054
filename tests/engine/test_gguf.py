"""GGUF loading: the Q/K un-permutation and the dequantized weights, against transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.models.gguf_loader import unpermute_rope_rows


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows (interleave the two rotary halves)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("num_heads, head_dim", [(9, 64), (3, 64), (4, 16)])
def test_unpermute_inverts_llama_cpp(num_heads, head_dim):
    weight = torch.randn(num_heads * head_dim, 24)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute_rope_rows(permuted, num_heads), weight)
    bias = torch.randn(num_heads * head_dim)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(bias, num_heads), num_heads), bias)


def test_converted_weights_equal_transformers_gguf_loading(smollm_dir, hf_smollm):
    ours = load_file(str(smollm_dir / "model.safetensors"))
    theirs = hf_smollm[0].state_dict()
    for name in ["model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight", "model.layers.7.self_attn.v_proj.weight",
                 "model.layers.29.mlp.down_proj.weight", "model.layers.3.input_layernorm.weight"]:
        assert torch.equal(ours[name], theirs[name]), name
    assert set(ours) == {n for n in theirs if n != "lm_head.weight"}
