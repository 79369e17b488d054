"""A `.gguf` path as --model: tiny Llama and Qwen2 GGUF files written here with the gguf
package (Q8_0 matrices, llama.cpp's Q/K permutation, SmolLM2's tokenizer metadata), loaded
by tandem and by transformers, generating the same greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from engine import SamplingParams
from tests.conftest import make_llm
from tests.engine.test_gguf import llama_cpp_permute
from tests.reference import EqualityStats, assert_token_equal, hf_greedy

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 160, 2, 4, 2, 49152

_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, index, rest = hf_name.split(".", 3)
        return f"blk.{index}.{_LAYER_NAMES[rest]}"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}[hf_name]


def _copy_tokenizer(writer: GGUFWriter, source: GGUFReader) -> None:
    fields = source.fields
    writer.add_tokenizer_model(fields["tokenizer.ggml.model"].contents())
    writer.add_tokenizer_pre(fields["tokenizer.ggml.pre"].contents())
    writer.add_token_list(fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)


def write_tiny_gguf(path, arch: str, tokenizer_source: GGUFReader) -> None:
    generator = torch.Generator().manual_seed(11 if arch == "llama" else 12)
    head_dim = HIDDEN // HEADS

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=generator) * scale

    state = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "model.norm.weight": 1 + rand(HIDDEN, scale=0.2)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": 1 + rand(HIDDEN, scale=0.2),
            p + "post_attention_layernorm.weight": 1 + rand(HIDDEN, scale=0.2),
            p + "self_attn.q_proj.weight": rand(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": rand(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.up_proj.weight": rand(FFN, HIDDEN),
            p + "mlp.down_proj.weight": rand(HIDDEN, FFN),
        })
        if arch == "qwen2":
            for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                state[p + f"self_attn.{proj}_proj.bias"] = rand(rows * head_dim, scale=0.5)
    if arch == "llama":
        state["lm_head.weight"] = rand(VOCAB, HIDDEN)  # untied; the qwen2 file ties embeddings

    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0 if arch == "llama" else 1e6)
    writer.add_file_type(7)  # mostly Q8_0
    _copy_tokenizer(writer, tokenizer_source)
    for name, tensor in state.items():
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            tensor = llama_cpp_permute(tensor, HEADS if "q_proj" in name else KV_HEADS)
        array = tensor.numpy().astype(np.float32)
        if array.ndim == 2:
            writer.add_tensor(_gguf_name(name), quantize(array, GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_path_matches_transformers(arch, tmp_path, monkeypatch, smollm_gguf):
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(path, arch, GGUFReader(str(smollm_gguf)))
    ours = make_llm(model=str(path), dtype="float32", num_kv_blocks=128)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (1, 9, 40, 130)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outputs = ours.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = EqualityStats()
    for ids, output in zip(prompts, outputs):
        ref_tokens, ref_logits = hf_greedy(reference, ids, 16)
        assert_token_equal(output.outputs[0].token_ids, ref_tokens, ref_logits, stats, label=f"{arch} {len(ids)}")
    assert stats.near_ties <= 1
    # converted once, then loaded from the cache
    assert len(list((tmp_path / "cache" / "gguf").glob("*/hf/model.safetensors"))) == 1
