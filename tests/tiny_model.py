"""A tiny randomly initialised checkpoint, written by transformers itself: for tests where the
real model is not the point (and as a second architecture to check against)."""

from __future__ import annotations

import shutil

import torch


def write_tiny_checkpoint(kind: str, directory, tokenizer_dir) -> None:
    """A tiny randomly initialised HF checkpoint written by transformers itself."""
    import transformers

    torch.manual_seed({"llama": 1, "qwen2": 2, "mistral": 3}[kind])
    common = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.3,  # wide logits: random models otherwise tie constantly
        bos_token_id=1,
        eos_token_id=2,
    )
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        config = transformers.LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                          tie_word_embeddings=True, use_sliding_window=False)
        model = transformers.Qwen2ForCausalLM(config)
        with torch.no_grad():  # make the q/k/v biases matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        config = transformers.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        model = transformers.MistralForCausalLM(config)
    with torch.no_grad():  # RMSNorm weights default to ones; perturb so they are really read
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return model.eval()
