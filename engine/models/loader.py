"""Build a model from an HF-style directory and load its safetensors weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.models.llama import (
    FUSED_PARAMS,
    CausalLM,
    RotaryEmbedding,
    interleave_rope_rows,
)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir} has no *.safetensors weights; pass a directory with safetensors "
            "(tandem does not load pickled .bin checkpoints)"
        )
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    weights[name] = handle.get_tensor(name)
        except Exception as exc:
            raise ValueError(
                f"could not read weights from {file} ({exc}); the file is corrupt or truncated: "
                "delete the model directory and fetch or copy it again"
            ) from exc
    return weights


def _to_model_names(weights: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """HF parameter names and layout -> ours: Q/K rows interleaved for in-place RoPE, q/k/v
    and gate/up concatenated (FUSED_PARAMS), a tied lm_head materialised."""
    weights = {n: t for n, t in weights.items() if not n.endswith("rotary_emb.inv_freq")}
    if arch.tie_word_embeddings or "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    for name in list(weights):
        if ".self_attn.q_proj." in name:
            weights[name] = interleave_rope_rows(weights[name], arch.num_attention_heads)
        elif ".self_attn.k_proj." in name:
            weights[name] = interleave_rope_rows(weights[name], arch.num_key_value_heads)
    for layer in range(arch.num_hidden_layers):
        for fused, parts in FUSED_PARAMS.items():
            for suffix in ("weight", "bias"):
                names = [f"model.layers.{layer}.{part}.{suffix}" for part in parts]
                if all(n in weights for n in names):
                    weights[f"model.layers.{layer}.{fused}.{suffix}"] = torch.cat([weights.pop(n) for n in names])
    return weights


def load_model(config: ModelConfig, backend: AttentionBackend, ops=None, device="cpu") -> CausalLM:
    arch = config.arch
    with torch.device("meta"):
        model = CausalLM(arch, config.max_model_len, backend, ops)
    weights = _to_model_names(_read_weights(config.model_dir), arch)
    expected = set(model.state_dict().keys())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if missing or unexpected:
        raise ValueError(
            f"{config.model_dir}: weights do not match a {arch.model_type} model "
            f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )
    state = {name: weights[name].to(device=device, dtype=config.dtype) for name in expected}
    model.load_state_dict(state, assign=True, strict=True)
    # the RoPE tables were created on the meta device; build them for real (float32)
    real = RotaryEmbedding(arch.head_dim, config.max_model_len, arch.rope_theta, arch.rope_scaling)
    model.model.rotary.cos, model.model.rotary.sin = real.cos.to(device), real.sin.to(device)
    model = model.eval().requires_grad_(False)
    model.pack_weights()
    return model
