"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) over a flattened, paged batch.

Every forward takes the whole step's tokens flattened into one dimension ([num_tokens]); the
attention backend maps them to their sequences and KV blocks. Q/K/V and gate/up projections
are fused into one matmul each (the loader concatenates the Hugging Face weights), which
halves the kernel launches of a decode step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.config import ModelArchConfig, RopeScaling
from engine.models.linear import Linear
from engine.models.ops import TorchOps

# fused parameter -> the Hugging Face parameters it concatenates (along dim 0), in order
FUSED_PARAMS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def run_to_end(layers: Generator[int, None, torch.Tensor]) -> torch.Tensor:
    """Run a ``CausalLM.forward_layers`` generator through; its result."""
    while True:
        try:
            next(layers)
        except StopIteration as stop:
            return stop.value


class RMSNorm(nn.Module):
    """Holds the weight; the model applies it fused with the residual add (models/ops.py)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


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
    """RoPE angles for every position up to max_positions, as float32 cos/sin tables."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)  # [max_positions, head_dim // 2]
        self.register_buffer("sin", angles.sin(), persistent=False)


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

    def forward(self, ops, rope, normed, kv_cache, attn_metadata) -> torch.Tensor:
        num_tokens = normed.shape[0]
        heads = self.num_heads
        # qkv: [T, heads + 2 * kv_heads, head_dim] = queries, keys, values
        qkv = self.qkv_proj(normed).view(num_tokens, heads + 2 * self.num_kv_heads, self.head_dim)
        ops.rope_(qkv[:, : heads + self.num_kv_heads], rope)  # queries and keys, in place
        # q: [T, heads, head_dim]; keys and values: [T, 2 * kv_heads, head_dim]
        out = self.backend.forward(qkv[:, :heads], qkv[:, heads:], kv_cache, attn_metadata)
        return self.o_proj(out.reshape(num_tokens, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelArchConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, ops, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))  # [T, intermediate] in between


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, backend: AttentionBackend):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, ops, rope, residual, normed, kv_cache, attn_metadata, next_norm: RMSNorm) -> torch.Tensor:
        """``normed`` is this layer's input norm of ``residual``. Adds attention and MLP into
        ``residual`` (in place) and returns ``next_norm`` of the result, each add fused with
        the norm that follows it."""
        attn = self.self_attn(ops, rope, normed, kv_cache, attn_metadata)
        post = self.post_attention_layernorm
        normed = ops.add_rms_norm_(residual, attn, post.weight, post.eps)
        return ops.add_rms_norm_(residual, self.mlp(ops, normed), next_norm.weight, next_norm.eps)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """``forward`` runs the decoder over one step; ``compute_logits`` projects chosen rows.
    ``ops`` (models/ops.py) supplies the fused small operations."""

    def __init__(self, cfg: ModelArchConfig, max_positions: int, backend: AttentionBackend, ops=None):
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, max_positions, backend)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.ops = ops if ops is not None else TorchOps()

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, block_size, 2 * kv_heads, head_dim]
        attn_metadata: object,
        layer_done: Callable[[int], None] | None = None,  # called after each layer (KV export)
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return run_to_end(self.forward_layers(input_ids, positions, kv_caches, attn_metadata, layer_done))

    def forward_layers(self, input_ids, positions, kv_caches, attn_metadata,
                       layer_done: Callable[[int], None] | None = None) -> Generator[int, None, torch.Tensor]:
        """``forward`` one layer per ``next()``: yields each layer's index once it is done and
        returns the hidden states. Any thread may resume it (one at a time), each layer then
        running on that thread's torch threads (the prefill lane: engine/prefill_lane.py)."""
        ops, decoder = self.ops, self.model
        residual = decoder.embed_tokens(input_ids)  # the residual stream, updated in place
        rope = ops.rope_state(positions, decoder.rotary.cos, decoder.rotary.sin)
        first = decoder.layers[0].input_layernorm
        normed = ops.add_rms_norm_(residual, None, first.weight, first.eps)
        norms_after = [layer.input_layernorm for layer in decoder.layers[1:]] + [decoder.norm]
        for index, (layer, kv_cache, next_norm) in enumerate(zip(decoder.layers, kv_caches, norms_after)):
            normed = layer(ops, rope, residual, normed, kv_cache, attn_metadata, next_norm)
            if layer_done is not None:
                layer_done(index)
            yield index
        return normed

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] f32
        return self.lm_head.forward_float32(hidden)

    def pack_weights(self) -> None:
        """Prepare every matmul weight for the fastest CPU kernel of its dtype."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
