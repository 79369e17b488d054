"""Prefix caching and chunked prefill on the real model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine import SamplingParams
from engine.kv_cache.block_hash import hash_blocks, namespace_digest
from tests.conftest import make_llm
from tests.reference import EqualityStats, assert_same_as_engine_reference

SYSTEM = (
    "You are a meticulous assistant. Answer every question with a short, precise sentence, "
    "cite no sources, and never repeat the question. " * 4
)
QUESTIONS = ["What is the boiling point of water?", "Who wrote Hamlet?", "What is 7 times 8?"]


@pytest.fixture(scope="module")
def uncached(smollm_dir):
    """The same model with prefix caching off: the reference for cached runs."""
    from engine import LLM

    return LLM(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024,
               enable_prefix_caching=False)


def test_digest_is_deterministic_across_processes():
    tokens = list(range(1000, 1100))
    here = hash_blocks(namespace_digest("m", 16, "float32"), tokens, 16, ("salt",))
    code = (
        "from engine.kv_cache.block_hash import hash_blocks, namespace_digest;"
        "print(','.join(h.hex() for h in hash_blocks(namespace_digest('m', 16, 'float32'),"
        " list(range(1000, 1100)), 16, ('salt',))))"
    )
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout.strip().split(",")
    assert [h.hex() for h in here] == there and len(here) == 6
    assert hash_blocks(namespace_digest("m", 16, "bfloat16"), tokens, 16)[0] != here[0]
    assert hash_blocks(namespace_digest("m", 16, "float32"), tokens, 16)[0] != here[0]  # salt matters


def test_shared_prefix_computes_only_uncached_tokens(smollm_dir, uncached):
    llm = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024)
    tokenizer = llm.get_tokenizer()
    runner = llm.engine_core.runner
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [SYSTEM + q for q in QUESTIONS]
    stats = EqualityStats()
    first = llm.generate(prompts[0], params)[0]
    assert first.num_cached_tokens == 0
    first_ids = tokenizer.encode(prompts[0])
    for prompt in prompts[1:]:
        ids = tokenizer.encode(prompt)
        common = next(i for i, (a, b) in enumerate(zip(ids, first_ids)) if a != b)
        before = runner.num_tokens_processed
        out = llm.generate(prompt, params)[0]
        processed = runner.num_tokens_processed - before
        cached = out.num_cached_tokens
        assert cached == common // 16 * 16 and cached >= 96  # every shared full block, no more
        # prefill computed exactly the uncached tokens, then one token per decode step
        assert processed == (len(ids) - cached) + (12 - 1)
        reference = uncached.generate(prompt, params)[0].outputs[0]
        assert_same_as_engine_reference(out.outputs[0].token_ids, reference, stats, label=prompt)
    assert stats.near_ties <= 1
    stats = llm.engine_core.kv_manager.stats
    assert stats.num_hit_tokens > 0 and stats.num_queried_tokens >= stats.num_hit_tokens


def test_evicted_blocks_never_serve_stale_content(smollm_dir, uncached):
    """A pool so small that cached prefixes are evicted and their blocks reused, with every
    discarded block filled with NaN: any stale reuse would poison the output."""
    llm = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=40, max_model_len=512,
                   free_order_seed=5)
    core = llm.engine_core
    core.block_pool.add_discard_listener(lambda ids: core.kv_cache.fill_blocks(ids, float("nan")))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    stats = EqualityStats()
    systems = [SYSTEM, SYSTEM.upper(), "Be brief. " * 30]
    order = [(s, q) for _ in range(2) for s in systems for q in QUESTIONS[:2]]
    for system, question in order:
        got = llm.generate(system + question, params)[0].outputs[0].token_ids
        reference = uncached.generate(system + question, params)[0].outputs[0]
        assert_same_as_engine_reference(got, reference, stats, label=question)
    assert stats.near_ties <= 1
    assert core.block_pool.num_evictions > 0
    assert core.kv_manager.stats.num_hit_tokens > 0


def test_chunked_prefill_matches_and_decodes_advance(smollm_dir, llm):
    chunked = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024,
                       max_num_batched_tokens=64)
    core = chunked.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=2)
    long_prompt = SYSTEM * 3 + "Summarise the instructions above."
    tokenizer = chunked.get_tokenizer()
    assert len(tokenizer.encode(long_prompt)) > 300
    engine = chunked.engine
    engine.add_request("short", "Count: 1, 2, 3,", tokenizer.encode("Count: 1, 2, 3,"), params)
    engine.step()
    engine.add_request("long", long_prompt, tokenizer.encode(long_prompt), params)
    mixed_steps = 0
    outputs = {}
    while engine.has_unfinished_requests():
        scheduled = core.scheduler.schedule
        plan = {}

        def spy():
            out = scheduled()
            plan.update({s.request_id: len(s.token_ids) for s in out.seqs})
            return out

        core.scheduler.schedule = spy
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output
        core.scheduler.schedule = scheduled
        if plan.get("short") == 1 and plan.get("long", 0) > 1:
            mixed_steps += 1
    assert mixed_steps >= 4  # the long prompt was read over several steps while short decoded
    reference = llm.generate([long_prompt, "Count: 1, 2, 3,"], params)
    stats = EqualityStats()
    assert_same_as_engine_reference(outputs["long"].outputs[0].token_ids, reference[0].outputs[0], stats, "long")
    assert_same_as_engine_reference(outputs["short"].outputs[0].token_ids, reference[1].outputs[0], stats, "short")
    assert stats.near_ties <= 1


def test_cache_salt_and_disabled_prefix_caching(smollm_dir):
    llm = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=128, max_model_len=512)
    params = SamplingParams(temperature=0.0, max_tokens=2)
    prompt = SYSTEM + QUESTIONS[0]
    llm.generate({"prompt": prompt, "cache_salt": "alice"}, params)
    assert llm.generate({"prompt": prompt, "cache_salt": "bob"}, params)[0].num_cached_tokens == 0
    assert llm.generate({"prompt": prompt, "cache_salt": "alice"}, params)[0].num_cached_tokens > 0
    with pytest.raises(ValueError, match="unknown prompt fields"):
        llm.generate({"prompt": prompt, "salt": "x"}, params)
    off = make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=64, max_model_len=512,
                   enable_prefix_caching=False)
    off.generate(prompt, params)
    assert off.generate(prompt, params)[0].num_cached_tokens == 0
    assert off.engine_core.block_pool.num_cached_blocks == 0


def test_hash_blocks_is_the_chain_of_hash_block():
    """The batched hashing (what the router runs per request) equals block-by-block hashing."""
    from engine.kv_cache.block_hash import hash_block, hash_blocks, namespace_digest

    namespace = namespace_digest("m", 4, "torch.float32")
    tokens = [(i * 31) % 1000 for i in range(19)]
    for extra in ((), ("tenant-a",)):
        expected, parent = [], namespace
        for index in range(4):
            parent = hash_block(parent, tokens[index * 4 : (index + 1) * 4], extra if index == 0 else ())
            expected.append(parent)
        assert hash_blocks(namespace, tokens, 4, extra) == expected
        assert hash_blocks(namespace, tokens, 4, extra, known=expected[:2]) == expected
