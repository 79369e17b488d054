"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

Parameter names follow Hugging Face so checkpoints load with ``load_state_dict``. Every
forward takes the whole step's tokens flattened into one dimension ([num_tokens]); the
attention backend maps them to their sequences and KV blocks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelArchConfig, RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in float32 whatever the model dtype, as the reference implementation does
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


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


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with cos/sin precomputed for every position up to max_positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_positions, head_dim // 2]
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.backend = backend

    def forward(self, positions, hidden, key_cache, value_cache, attn_metadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)  # q: [T, heads, head_dim]
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)  # k: [T, kv_heads, head_dim]
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        q = self.rotary(positions, q)
        k = self.rotary(positions, k)
        out = self.backend.forward(q, k, v, key_cache, value_cache, attn_metadata)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions, hidden, key_cache, value_cache, attn_metadata):
        hidden = hidden + self.self_attn(
            positions, self.input_layernorm(hidden), key_cache, value_cache, attn_metadata
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` runs the decoder over one step; ``compute_logits`` projects chosen rows."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, backend)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer (key_cache, value_cache)
        attn_metadata: object,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self.model.embed_tokens(input_ids)
        for layer, (key_cache, value_cache) in zip(self.model.layers, kv_caches):
            hidden = layer(positions, hidden, key_cache, value_cache, attn_metadata)
        return self.model.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()
