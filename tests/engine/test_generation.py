"""Generation behaviour on the real model: batching, paging, sampling, stops, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine import SamplingParams
from tests.conftest import make_llm
from tests.reference import EqualityStats, assert_same_as_engine_reference

PROMPTS = [
    "The quick brown fox",
    "In the beginning of the universe there was",
    "Python is a programming language that",
    "My favourite recipe for a chocolate cake starts with",
    "The three laws of robotics are",
    "Water boils at",
]


def _ids(llm, prompts):
    return [llm.get_tokenizer().encode(p) for p in prompts]


def test_batch_is_one_forward_pass_per_step(llm):
    """N requests together take max_tokens steps, not N times that; each sequence equals
    the same sequence generated alone (token-equality rule, with the batch run as reference)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    runner = llm.engine_core.runner
    before = runner.num_forward_calls
    together = llm.generate(PROMPTS, params)
    assert runner.num_forward_calls - before == 12  # step 1 prefills all and samples token 1
    stats = EqualityStats()
    for prompt, batched in zip(PROMPTS, together):
        before = runner.num_forward_calls
        alone = llm.generate(prompt, params)[0].outputs[0]
        assert runner.num_forward_calls - before == 12
        assert_same_as_engine_reference(batched.outputs[0].token_ids, alone, stats, label=prompt)
    print(f"batched vs alone: near-tie rule fired {stats.near_ties} of {stats.compared}")
    assert stats.near_ties <= 1


def test_cache_is_really_paged(smollm_dir, llm):
    """Shuffled free list + freed blocks poisoned with NaN: outputs unchanged."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
    expected = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    stats = EqualityStats()
    paged = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=96, max_model_len=512, free_order_seed=1234)
    core = paged.engine_core
    core.block_pool.add_discard_listener(lambda ids: core.kv_cache.fill_blocks(ids, float("nan")))
    core.kv_cache.fill_blocks(list(range(core.block_pool.num_blocks)), float("nan"))  # never-written too
    for _ in range(2):  # the second round runs on blocks freed (and poisoned) by the first
        got = [o.outputs[0].token_ids for o in paged.generate(PROMPTS[::-1], params)][::-1]
        for mine, reference in zip(got, expected):
            assert_same_as_engine_reference(mine, reference, stats, label="paged")
    assert stats.near_ties <= 1
    # the shuffled pool really hands out scattered blocks
    probe = core.make_request("probe", list(range(10, 60)), params)
    core.add_request(probe)
    core.step()
    table = core.kv_manager.block_table("probe")
    assert len(table) == 4 and table != list(range(table[0], table[0] + 4))
    core.abort_request("probe")


def test_top_k_one_equals_greedy(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    topk1 = llm.generate(PROMPTS, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in topk1]


def test_seed_reproduces_across_batch_compositions(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=42, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    mixed = llm.generate(PROMPTS[1:4] + [PROMPTS[0]] + PROMPTS[4:], [others] * 3 + [params] + [others] * 2)
    assert mixed[3].outputs[0].token_ids == alone
    reseeded = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=43, ignore_eos=True))
    assert reseeded[0].outputs[0].token_ids != alone  # the seed matters


def test_n_sequences_with_seed(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True)
    first = llm.generate(PROMPTS[2], params)[0]
    second = llm.generate(PROMPTS[2], params)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1


def test_unseeded_sampling_varies(llm):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = {tuple(llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids) for _ in range(3)}
    assert len(runs) > 1


def test_stop_strings_cut_exactly(llm):
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    # choose a stop string from the middle of the greedy text
    words = base.text.split()
    assert len(words) > 4, base.text
    stop = " " + words[3]
    cut_at = base.text.index(stop)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.text == base.text[:cut_at]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text
    assert out.token_ids == base.token_ids[: len(out.token_ids)]


def test_stop_token_ids_eos_min_and_max_tokens(llm):
    base = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    eos = llm.info.eos_token_ids
    stop_id = next(t for t in base.token_ids[2:] if t not in eos)
    first_hit = base.token_ids.index(stop_id)
    out = llm.generate(
        PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True)
    )[0].outputs[0]
    assert out.token_ids == base.token_ids[: first_hit + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    # a chat turn ends with <|im_end|> (EOS): stops by itself, EOS id kept, its text not
    chat = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(temperature=0.0, max_tokens=64))[0].outputs[0]
    assert chat.finish_reason == "stop" and chat.token_ids[-1] in eos and "<|im_end|>" not in chat.text
    longer = llm.chat(
        [{"role": "user", "content": "Say hello."}],
        SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(chat.token_ids) + 3),
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(chat.token_ids) + 3
    assert not any(t in eos for t in longer.token_ids[: len(chat.token_ids) + 2])


def test_logprobs_equal_transformers_log_softmax(llm, hf_smollm):
    hf_model, _ = hf_smollm
    prompt_ids = _ids(llm, [PROMPTS[4]])[0]
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=8, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt_ids}, params)[0]
    completion = output.outputs[0]
    full = prompt_ids + completion.token_ids
    with torch.inference_mode():
        ref = hf_model(input_ids=torch.tensor([full])).logits[0].float().log_softmax(-1)  # [len, vocab]
    total = 0.0
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        row = ref[len(prompt_ids) - 1 + step]
        assert token in entry and len(entry) in (5, 6)
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = row.topk(5)
        for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
            assert entry[tid].rank == rank
        total += entry[token].logprob
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # prompt logprobs: None first, then each prompt token scored by the positions before it
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        entry = output.prompt_logprobs[position]
        token = prompt_ids[position]
        assert entry[token].logprob == pytest.approx(float(ref[position - 1, token]), abs=1e-4)
        assert entry[token].decoded_token == llm.get_tokenizer().token_text(token)


def test_penalties_change_output_and_match_definition(llm):
    greedy = llm.generate(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    penalised = llm.generate(
        PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)
    )[0].outputs[0]
    assert len(set(penalised.token_ids)) >= len(set(greedy.token_ids))
    rep = llm.generate(
        PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=1.8)
    )[0].outputs[0]
    assert rep.token_ids != greedy.token_ids


def test_dtypes_run(smollm_dir):
    for dtype in ("bfloat16", "float16"):
        low = make_llm(model=str(smollm_dir), dtype=dtype, num_kv_blocks=64, max_model_len=512)
        assert low.engine_core.kv_cache.layers[0].dtype == getattr(torch, dtype)
        text = low.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6))[0].outputs[0].text
        assert "Paris" in text, (dtype, text)
        del low


def test_logprob_values_are_probabilities(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=0))[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert list(entry) == [token] and entry[token].rank == 1
        assert 0.0 < math.exp(entry[token].logprob) <= 1.0


def test_chunked_prefill_and_preemption_keep_outputs(llm, smollm_dir):
    """A tight token budget (prompts read in chunks) and a pool too small for every
    sequence (preemption by recompute) give the same tokens and prompt logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, prompt_logprobs=2, logprobs=2)
    prompts = [p + " and then, after a long pause, it continued" for p in PROMPTS]
    expected = llm.generate(prompts, params)
    tight = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=16, max_model_len=256,
                     max_num_batched_tokens=24)
    got = tight.generate(prompts, params)
    assert tight.engine_core.scheduler.num_preemptions > 0
    stats = EqualityStats()
    for a, b in zip(expected, got):
        assert_same_as_engine_reference(b.outputs[0].token_ids, a.outputs[0], stats, label="tight")
    assert stats.near_ties <= 1
    for a, b in zip(expected, got):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids) and b.prompt_logprobs[0] is None
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert pa.keys() == pb.keys()
            for token_id in pa:
                assert pb[token_id].logprob == pytest.approx(pa[token_id].logprob, abs=1e-4)


def test_abort_mid_generation_frees_blocks(llm):
    engine = llm.engine
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(n=2, temperature=0.9, max_tokens=50, ignore_eos=True)
    engine.add_request("to-abort", PROMPTS[0], tokenizer.encode(PROMPTS[0]), params)
    engine.add_request("to-finish", PROMPTS[1], tokenizer.encode(PROMPTS[1]), SamplingParams(max_tokens=3, ignore_eos=True))
    for _ in range(4):
        engine.step()
    pool = llm.engine_core.block_pool
    assert pool.num_free_blocks < pool.num_blocks
    aborted = engine.abort_request("to-abort")
    assert aborted.finished and [c.finish_reason for c in aborted.outputs] == ["abort", "abort"]
    assert 0 < len(aborted.outputs[0].token_ids) < 50
    assert engine.abort_request("to-abort") is None  # idempotent
    assert not engine.has_unfinished_requests()  # the other one finished at max_tokens=3
    assert pool.num_free_blocks == pool.num_blocks


def test_generation_config_defaults_apply(tmp_path, smollm_dir):
    import json
    import shutil

    model_dir = tmp_path / "with-defaults"
    shutil.copytree(smollm_dir, model_dir)
    (model_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 0], "temperature": 0.0, "max_new_tokens": 5, "top_k": 20})
    )
    custom = make_llm(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    defaults = custom.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens, defaults.top_k) == (0.0, 5, 20)
    assert custom.info.eos_token_ids == (2, 0)
    out = custom.generate(PROMPTS[0])[0].outputs[0]  # no params: the checkpoint's defaults
    explicit = custom.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5))[0].outputs[0]
    assert out.token_ids == explicit.token_ids and len(out.token_ids) <= 5
