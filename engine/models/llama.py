"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

Every forward takes the whole step's tokens flattened into one dimension ([num_tokens]); the
attention backend maps them to their sequences and KV blocks. Q/K/V and gate/up projections
are fused into one matmul each (the loader concatenates the Hugging Face weights), which
halves the kernel launches of a decode step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelArchConfig, RopeScaling
from engine.models.linear import Linear

# fused parameter -> the Hugging Face parameters it concatenates (along dim 0), in order
FUSED_PARAMS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused call (it normalises in float32 for low-precision inputs)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], with llama3 wavelength-dependent scaling if set."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    # llama3: long wavelengths (low frequencies) are slowed down by `factor`, short ones kept,
    # and the band in between is interpolated linearly in 1 / wavelength.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    slow = inv_freq / scaling.factor
    blend = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    mid = (1 - blend) * slow + blend * inv_freq
    is_long = wavelen > old_len / scaling.low_freq_factor
    is_short = wavelen < old_len / scaling.high_freq_factor
    return torch.where(is_long, slow, torch.where(is_short, inv_freq, mid))


def interleave_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder Q/K projection rows, per head, from rotate-half order (x_0 .. x_{d/2-1},
    x_{d/2} .. x_{d-1}) to interleaved pairs (x_0, x_{d/2}, x_1, x_{d/2+1}, ...), so that RoPE
    becomes one complex multiply in place. Q and K get the same order, so q . k is unchanged.

    weight: [num_heads * head_dim, ...] (a bias too)
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return (
        weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
        .contiguous()
    )


class RotaryEmbedding(nn.Module):
    """RoPE as complex rotations e^{i * position * freq} for every position up to
    max_positions; looked up once per step and shared by all layers."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("rotations", torch.polar(torch.ones_like(freqs), freqs), persistent=False)

    def lookup(self, positions: torch.Tensor) -> torch.Tensor:
        return self.rotations[positions].unsqueeze(1)  # [num_tokens, 1, head_dim // 2] complex64


def apply_rope_(x: torch.Tensor, rotations: torch.Tensor) -> None:
    """Rotate x in place. x: [num_tokens, heads, head_dim] in interleaved-pair order."""
    pairs = x.unflatten(-1, (-1, 2))  # [T, heads, head_dim // 2, 2]
    if x.dtype == torch.float32:
        torch.view_as_complex(pairs).mul_(rotations)
    else:  # no complex bfloat16: rotate in float32 and write back
        rotated = torch.view_as_complex(pairs.float()) * rotations
        pairs.copy_(torch.view_as_real(rotated))


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_rows, bias=cfg.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.backend = backend

    def forward(self, rope, hidden, kv_cache, attn_metadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        heads = self.num_heads
        # qkv: [T, heads + 2 * kv_heads, head_dim] = queries, keys, values
        qkv = self.qkv_proj(hidden).view(num_tokens, heads + 2 * self.num_kv_heads, self.head_dim)
        apply_rope_(qkv[:, : heads + self.num_kv_heads], rope)  # queries and keys, in place
        # q: [T, heads, head_dim]; keys and values: [T, 2 * kv_heads, head_dim]
        out = self.backend.forward(qkv[:, :heads], qkv[:, heads:], kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, intermediate] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, rope, hidden, kv_cache, attn_metadata):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, attn_metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` runs the decoder over one step; ``compute_logits`` projects chosen rows."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, 2 * kv_heads, head_dim]
        attn_metadata: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.model.embed_tokens(input_ids)
        rope = self.model.rotary.lookup(positions)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            hidden = layer(rope, hidden, kv_cache, attn_metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        return self.lm_head(hidden).float()

    def pack_weights(self) -> None:
        """Prepare every matmul weight for the fastest CPU kernel of its dtype."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
