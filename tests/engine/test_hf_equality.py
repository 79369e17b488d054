"""Greedy generation equals transformers on the same weights (DESIGN.md token-equality rule)."""

from __future__ import annotations

import functools

import pytest
import torch

from engine import SamplingParams
from tests.conftest import make_llm
from tests.reference import EqualityStats, assert_token_equal, hf_greedy
from tests.tiny_model import write_tiny_checkpoint

NEW_TOKENS = 32

PROMPTS = [
    "Hi",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three primary colors:",
    "Translate to French: 'The weather is nice today, and I would like to go for a walk in the park.'",
    "Explain, step by step, how photosynthesis converts light into chemical energy in plants. "
    * 6,
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,",
    "Question: what is 17 * 23? Answer:",
]


@pytest.fixture(params=["native", "other-f32-matmul", "torch"])
def engine_under_test(request, llm, smollm_dir, monkeypatch):
    """The engine with native CPU kernels (the default), the same with the float32 matmul this
    CPU did not choose (oneDNN with packed weights, or torch's default: each machine runs
    both), and with plain torch ops only."""
    if request.param == "native":
        assert llm.engine_core.model.ops.name == "native", "native kernels should build here"
        return llm
    if request.param == "other-f32-matmul":
        from engine.models import linear

        chosen = linear.onednn_f32_faster()
        monkeypatch.setattr(linear, "onednn_f32_faster", lambda: not chosen)
        other = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024)
        head = other.engine_core.model.lm_head
        assert (head._packed is not None) == (not chosen)
        return other
    monkeypatch.setenv("TANDEM_DISABLE_NATIVE_KERNELS", "1")
    plain = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024)
    assert plain.engine_core.model.ops.name == "torch"
    return plain


@functools.cache
def reference(hf_model, prompt_ids: tuple[int, ...]) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy run of a prompt, computed once for all the engines compared with it."""
    return hf_greedy(hf_model, list(prompt_ids), NEW_TOKENS)


def test_smollm2_batch_matches_transformers(engine_under_test, hf_smollm):
    llm = engine_under_test
    hf_model, _ = hf_smollm
    tokenizer = llm.get_tokenizer()
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert len({len(ids) for ids in prompt_ids}) >= 8, "prompts should have different lengths"
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)  # one batch
    stats = EqualityStats()
    for ids, output in zip(prompt_ids, outputs):
        ref_tokens, ref_logits = reference(hf_model, tuple(ids))
        ours = output.outputs[0].token_ids
        assert len(ours) == NEW_TOKENS
        assert_token_equal(ours, ref_tokens, ref_logits, stats, label=f"prompt of {len(ids)} tokens")
    print(f"token-equality: {stats.compared} sequences, near-tie rule fired {stats.near_ties} times")
    assert stats.near_ties <= 2, "the near-tie rule should be rare"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tiny_random_checkpoints_match_transformers(kind, tmp_path, smollm_dir):
    model_dir = tmp_path / kind
    hf_model = write_tiny_checkpoint(kind, model_dir, smollm_dir)
    ours = make_llm(model=str(model_dir), dtype="float32", num_kv_blocks=256)
    generator = torch.Generator().manual_seed(7)
    # lengths up to 300 so llama3 rope scaling (original context 64) is exercised
    prompt_ids = [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (1, 5, 17, 33, 64, 100, 150, 300)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outputs = ours.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    stats = EqualityStats()
    for ids, output in zip(prompt_ids, outputs):
        ref_tokens, ref_logits = hf_greedy(hf_model, ids, NEW_TOKENS)
        assert_token_equal(output.outputs[0].token_ids, ref_tokens, ref_logits, stats, label=f"{kind} len {len(ids)}")
    print(f"{kind}: {stats.compared} sequences, near-tie rule fired {stats.near_ties} times")
    assert stats.near_ties <= 2
