"""The bfloat16 prefill attention kernel (engine/kernels/prefill_attention.cpp) against float32
SDPA on the same bfloat16 inputs, and the engine with it against the engine with SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_gemv, prefill_attention

pytestmark = pytest.mark.skipif(
    not cpu_gemv.cpu_supports_avx512_bf16(), reason="this CPU has no AVX-512 BF16 (the kernel is not used here)"
)


@pytest.fixture(scope="module")
def kernel():
    module = prefill_attention.load()
    assert module is not None, "the prefill kernel must build on a CPU with AVX-512 BF16"
    return module


def chunk_case(heads, kv_heads, head_dim, block_size, seq_len, q_len, seed):
    """A sequence's K/V written through a shuffled block table into a NaN cache (only its
    positions are written), and its last ``q_len`` queries as a strided view of a fused QKV
    row, as the model passes them: (query, cache, table, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    count = -(-seq_len // block_size)
    num_blocks = count + 3
    cache = torch.full((num_blocks, block_size, 2 * kv_heads, head_dim), float("nan")).to(torch.bfloat16)
    table = torch.randperm(num_blocks, generator=g)[:count]
    keys = torch.randn(seq_len, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    values = torch.randn(seq_len, kv_heads, head_dim, generator=g).to(torch.bfloat16)
    pos = torch.arange(seq_len)
    cache[table[pos // block_size], pos % block_size, :kv_heads] = keys
    cache[table[pos // block_size], pos % block_size, kv_heads:] = values
    qkv = torch.randn(q_len, heads + 2 * kv_heads, head_dim, generator=g).to(torch.bfloat16)
    return qkv[:, :heads], cache, table, keys, values


def reference(query, keys, values, seq_len):
    """float32 causal SDPA: query j at position seq_len - q_len + j sees keys <= it."""
    q_len = query.shape[0]
    visible = torch.arange(seq_len).unsqueeze(0) <= torch.arange(seq_len - q_len, seq_len).unsqueeze(1)
    return F.scaled_dot_product_attention(
        query.float().transpose(0, 1), keys.float().transpose(0, 1), values.float().transpose(0, 1),
        attn_mask=visible, enable_gqa=True,
    ).transpose(0, 1)  # [q_len, heads, head_dim]


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 64), (32, 8, 128)])
@pytest.mark.parametrize("block_size", [16, 64, 128])
@pytest.mark.parametrize("seq_len, q_len", [(250, 250), (300, 37), (1, 1), (700, 1), (130, 129), (17, 16)])
def test_matches_float32_sdpa(kernel, heads, kv_heads, head_dim, block_size, seq_len, q_len):
    """Whole prompts, chunks after a cached prefix, single tokens; tiles cut anywhere. The
    error is bfloat16's: at most the rounding of the exact result plus a few units of the
    rounded probabilities' error."""
    query, cache, table, keys, values = chunk_case(heads, kv_heads, head_dim, block_size, seq_len, q_len,
                                                   seq_len * 7 + q_len)
    out = kernel.paged_prefill_attention(query, cache, table, seq_len, head_dim**-0.5)
    expected = reference(query, keys, values, seq_len)
    assert out.shape == (q_len, heads, head_dim) and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    rounding = (expected.to(torch.bfloat16).float() - expected).abs().max()
    assert (out.float() - expected).abs().max() <= rounding + 4e-3


@pytest.mark.parametrize("threads", [1, 2])
def test_is_thread_invariant_and_reads_only_its_context(kernel, threads):
    """Bitwise the same on 1 or 2 threads, and whatever the cache holds outside the
    sequence's positions (NaN in the chunk case; here other values)."""
    query, cache, table, _, _ = chunk_case(9, 3, 64, 16, 333, 200, 5)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        first = kernel.paged_prefill_attention(query, cache, table, 333, 0.125)
        outside = torch.ones(cache.shape[0], dtype=torch.bool)
        outside[table] = False
        cache[outside] = 7.0
        cache[table[-1], 333 % 16:] = -3.0  # the tail of the last block
        second = kernel.paged_prefill_attention(query, cache, table, 333, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(first, second)
    torch.set_num_threads(1 if threads == 2 else 2)
    try:
        other = kernel.paged_prefill_attention(query, cache, table, 333, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(first, other)


def test_validates_inputs(kernel):
    cache = torch.zeros(4, 16, 6, 64, dtype=torch.bfloat16)
    query = torch.zeros(3, 9, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_prefill_attention(query, cache, torch.tensor([7]), 3, 0.125)
    with pytest.raises(RuntimeError, match="bad lengths"):
        kernel.paged_prefill_attention(query, cache, torch.tensor([0]), 17, 0.125)
    with pytest.raises(RuntimeError, match="bad lengths"):
        kernel.paged_prefill_attention(query, cache, torch.tensor([0]), 2, 0.125)
    with pytest.raises(RuntimeError, match="bf16 query"):
        kernel.paged_prefill_attention(query.float(), cache, torch.tensor([0]), 3, 0.125)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        kernel.paged_prefill_attention(torch.zeros(3, 9, 32, dtype=torch.bfloat16),
                                       torch.zeros(4, 16, 6, 32, dtype=torch.bfloat16), torch.tensor([0]), 3, 0.125)
    assert kernel.supports(64, 3) and kernel.supports(128, 8)
    assert not kernel.supports(64, 9) and not kernel.supports(96, 1)


@pytest.mark.skipif(prefill_attention.sdpa_is_faster(),
                    reason="this CPU has AMX: the engine keeps SDPA for prefill here and never runs the kernel (the "
                           "kernel itself is checked against float32 above, and the choice below)")
def test_the_engine_uses_it_and_agrees_with_sdpa(smollm_dir, monkeypatch):
    """bfloat16 SmolLM2 with the kernel, prompts whole and in chunks of 40 (each chunk after a
    cached prefix), against the same engine with torch's SDPA for prefill, prompts whole:
    greedy outputs equal under DESIGN.md's rule at bfloat16's margin (BF16_TIE_MARGIN) and
    prompt logprobs within bfloat16's noise (0.12 measured here)."""
    from engine import LLM, SamplingParams
    from tests.reference import BF16_TIE_MARGIN, EqualityStats, assert_same_as_engine_reference

    # distinct texts (a near-tie in one shared continuation would recur in every copy)
    prompts = [topic * 6 for topic in ("The history of the printing press begins ", "Rivers carve valleys when ",
                                       "A recipe for bread needs flour, ", "In the old observatory, the telescope ",
                                       "The rules of chess say that ", "Autumn leaves turn red because ")]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=1, logprobs=2)

    def run(chunk: int):
        llm = LLM(model=str(smollm_dir), dtype="bfloat16", num_kv_blocks=96, max_model_len=512,
                  max_num_batched_tokens=chunk, num_threads=2)
        uses_kernel = llm.engine_core.model.model.layers[0].self_attn.backend.prefill is not None
        return llm.generate(prompts, params), uses_kernel

    whole, used = run(512)
    chunked, _ = run(40)
    assert used
    monkeypatch.setattr(prefill_attention, "for_model", lambda *a: None)
    expected, used = run(512)
    assert not used
    stats = EqualityStats()
    worst = 0.0
    for got in (whole, chunked):
        for a, b in zip(expected, got):
            assert_same_as_engine_reference(b.outputs[0].token_ids, a.outputs[0], stats, "prefill kernel",
                                            BF16_TIE_MARGIN)
            for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
                token = next(iter(pa.keys() & pb.keys()))  # the prompt's own token is in both
                worst = max(worst, abs(pa[token].logprob - pb[token].logprob))
    print(f"prefill kernel vs SDPA: max prompt logprob difference {worst:.3f}, near-ties {stats.near_ties} of "
          f"{stats.compared}")
    assert worst < 0.25
    # the whole and the chunked run share the kernel, so a bfloat16 tie that it and SDPA round
    # apart shows in both; over 24 greedy tokens such ties are not rare in bfloat16 (2 of these 6
    # prompts on a Xeon). DESIGN.md's bound on the rule: it must not fire for most of them.
    assert stats.near_ties * 2 < stats.compared


@pytest.mark.parametrize("flags,expected", [({"avx512f", "avx512_bf16"}, True),
                                            ({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, False)])
def test_the_engine_takes_the_kernel_only_where_the_cpu_has_no_amx(monkeypatch, flags, expected):
    """With AMX, torch's SDPA runs its tiles on AMX and beats the kernel (2-3x at 256-1024
    positions, measured on a Xeon): for_model leaves prefill to SDPA there, and only there."""
    from types import SimpleNamespace

    monkeypatch.setattr(prefill_attention, "cpu_flags", lambda: flags)
    arch = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's
    chosen = prefill_attention.for_model(arch, torch.bfloat16, torch.device("cpu"))
    assert (chosen is not None) is expected
    assert prefill_attention.for_model(arch, torch.float32, torch.device("cpu")) is None
