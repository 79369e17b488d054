"""Read a GGUF file into a Hugging Face-style checkpoint (config, safetensors, tokenizer).

llama.cpp's converter renames every tensor, stores the config as metadata, quantizes the
matrices, and permutes the rows of the Q and K projections of Llama models so that its RoPE
kernel can rotate adjacent pairs. Loading undoes all four: HF names, an HF config.json,
dequantized float32 weights, and the original (rotate-half) row order.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# GGUF tensor name (per block, without the "blk.N." prefix) -> HF parameter name suffix.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF architecture -> HF model_type. Only Llama's Q/K rows are permuted by llama.cpp.
_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHITECTURES = {"llama"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(ValueError):
    """The GGUF file cannot be turned into a model tandem runs (names the file and the cause)."""


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    config: dict  # HF config.json contents
    state_dict: dict[str, torch.Tensor]  # HF parameter name -> float32 tensor
    chat_template: str | None  # Jinja source from tokenizer.chat_template
    bos_token_id: int | None
    eos_token_id: int | None


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's Q/K permutation: per head, rows [0, 1, 2, 3, ...] stored as pairs
    (x0, x_{d/2}, x1, x_{d/2+1}, ...) go back to halves (x0 .. x_{d/2-1}, x_{d/2} .. x_{d-1}).

    weight: [num_heads * head_dim, in_features] (or [num_heads * head_dim] for a bias)
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    # stored layout per head: [head_dim // 2, 2] -> original layout per head: [2, head_dim // 2]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest)
        .transpose(1, 2)
        .reshape(rows, *rest)
        .contiguous()
    )


def _config_from_metadata(reader, arch: str, tensor_names: set[str], path: Path) -> dict:
    def need(key: str):
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{path}: GGUF metadata lacks '{arch}.{key}'; the file is incomplete")
        return value

    num_heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    if "rope_freqs.weight" in tensor_names:
        raise GGUFError(
            f"{path}: this GGUF stores per-frequency RoPE factors (rope_freqs), which tandem "
            "does not read from GGUF; use the Hugging Face checkpoint of this model instead"
        )
    config = {
        "model_type": _ARCHITECTURES[arch],
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    return config


def read_gguf(path: Path, progress: Callable[[str], None] = lambda _msg: None) -> GGUFCheckpoint:
    """Dequantize every tensor of a Llama/Qwen2 GGUF into HF names and layout (float32)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueErrors on bad magic etc.
        raise GGUFError(f"{path}: not a readable GGUF file ({exc}); re-fetch or re-export it") from exc
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise GGUFError(
            f"{path}: GGUF architecture '{arch}' is not supported (supported: {sorted(_ARCHITECTURES)})"
        )
    tensor_names = {t.name for t in reader.tensors}
    config = _config_from_metadata(reader, arch, tensor_names, path)
    state_dict: dict[str, torch.Tensor] = {}
    total = len(reader.tensors)
    for index, tensor in enumerate(reader.tensors):
        if index % 32 == 0 or index == total - 1:
            progress(f"dequantizing tensors {index + 1}/{total}")
        match = _LAYER_NAME.match(tensor.name)
        if match:
            suffix = _LAYER_TENSORS.get(match.group(2))
            name = f"model.layers.{match.group(1)}.{suffix}" if suffix else None
        else:
            name = _GLOBAL_TENSORS.get(tensor.name)
        if name is None:
            raise GGUFError(f"{path}: unexpected tensor '{tensor.name}' for architecture {arch}")
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        if arch in _PERMUTED_ARCHITECTURES and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif arch in _PERMUTED_ARCHITECTURES and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        state_dict[name] = weight
    return GGUFCheckpoint(
        config=config,
        state_dict=state_dict,
        chat_template=_field(reader, "tokenizer.chat_template"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
    )


def write_tokenizer_from_gguf(path: Path, out_dir: Path) -> None:
    """Build tokenizer.json from the GGUF's tokenizer metadata (transformers knows every
    tokenizer model llama.cpp writes) and save it in HF layout under ``out_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out_dir))
    if not (out_dir / "tokenizer.json").exists():
        raise GGUFError(f"{path}: transformers could not produce a fast tokenizer from this GGUF")


def convert_gguf(path: Path, out_dir: Path, progress: Callable[[str], None]) -> None:
    """Write an HF directory (config.json, model.safetensors, tokenizer files,
    generation_config.json) for the GGUF at ``path``."""
    from safetensors.torch import save_file

    checkpoint = read_gguf(path, progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    progress("writing dequantized weights (safetensors)")
    save_file(checkpoint.state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(checkpoint.config, indent=2))
    generation = {k: checkpoint.config[k] for k in ("bos_token_id", "eos_token_id") if k in checkpoint.config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    progress("building tokenizer from GGUF metadata")
    write_tokenizer_from_gguf(path, out_dir)
    if checkpoint.chat_template:
        (out_dir / "chat_template.jinja").write_text(checkpoint.chat_template)
