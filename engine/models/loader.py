"""Build a model from an HF-style directory and load its safetensors weights."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.attention.backend import AttentionBackend
from engine.config import ModelConfig
from engine.models.llama import CausalLM, RotaryEmbedding


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


def load_model(config: ModelConfig, backend: AttentionBackend) -> CausalLM:
    arch = config.arch
    with torch.device("meta"):
        model = CausalLM(arch, config.max_model_len, backend)
    weights = _read_weights(config.model_dir)
    # HF checkpoints may prefix "model." differently or carry a tied lm_head copy
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    expected = set(model.state_dict().keys())
    missing = expected - set(weights)
    unexpected = set(weights) - expected
    unexpected = {n for n in unexpected if not n.endswith("rotary_emb.inv_freq")}
    if missing or unexpected:
        raise ValueError(
            f"{config.model_dir}: weights do not match a {arch.model_type} model "
            f"(missing: {sorted(missing)[:5]}, unexpected: {sorted(unexpected)[:5]})"
        )
    state = {name: weights[name].to(config.dtype) for name in expected}
    model.load_state_dict(state, assign=True, strict=True)
    # buffers (RoPE tables) were created on meta; rebuild them for real
    rotary = model.model.layers[0].self_attn.rotary if arch.num_hidden_layers else None
    if rotary is not None:
        real = RotaryEmbedding(arch.head_dim, config.max_model_len, arch.rope_theta, arch.rope_scaling)
        rotary.cos = real.cos
        rotary.sin = real.sin
    return model.eval().requires_grad_(False)
