"""Disaggregation on the engine level: a prefill engine computes the prompt and exports its
KV layer by layer, a decode engine imports it into reserved blocks and generates the rest,
through the in-process transport twin."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.remote_kv import KVExport, KVFailurePolicy, prefill_side_params
from engine.scheduler_types import SampledToken, ScheduledSeq
from kv_transfer.inbox import EngineInbox, TransferFailed
from kv_transfer.inprocess import InProcessKVSink
from tests.conftest import make_engine_pair
from tests.kv_transfer.helpers import RecordsSent, assert_landed_equals_sent, disaggregated
from tests.reference import EqualityStats, assert_same_as_engine_reference

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Explain, step by step, how photosynthesis converts light into chemical energy in plants. " * 3,
]


@pytest.fixture(scope="module")
def pair(smollm_dir):
    return make_engine_pair(smollm_dir)


class _Recorder(RecordsSent, InProcessKVSink):
    """Also keeps what was sent, to compare with what landed."""


def test_disaggregated_greedy_equals_colocated(pair, llm):
    prefill, decode = pair
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    decode_prefilled_before = decode.runner.num_tokens_processed
    tokens, sink = disaggregated(prefill, decode, PROMPTS, params, _Recorder(decode))
    reference = llm.generate(PROMPTS, params.with_overrides(logprobs=2))
    stats = EqualityStats()
    for index, ref in enumerate(reference):
        assert_same_as_engine_reference(tokens[f"r{index}"], ref.outputs[0], stats, label=PROMPTS[index][:20])
    assert stats.near_ties <= 1
    # the decode engine computed no prompt token: one token per decode step per request
    assert decode.runner.num_tokens_processed - decode_prefilled_before == len(PROMPTS) * (16 - 1)
    assert sink.closed == {f"r{i}": "length" for i in range(len(PROMPTS))}  # prefill side done
    prompt_tokens = sum(len(decode.tokenizer.encode(p)) for p in PROMPTS)
    arch = decode.config.model.arch
    per_token = 2 * arch.num_key_value_heads * arch.head_dim * 4 * arch.num_hidden_layers
    assert sink.bytes_sent == prompt_tokens * per_token


def test_kv_received_equals_kv_sent_bit_for_bit(pair):
    prefill, decode = pair
    sink = _Recorder(decode)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    ids = decode.tokenizer.encode(PROMPTS[1])
    remote = decode.make_request("bits", ids, params.with_overrides(max_tokens=2))
    from_pos = decode.add_remote_request(remote, deadline_s=120)
    prefill.add_request(prefill.make_request("bits", ids, prefill_side_params(params, remote.seed)), KVExport(sink, from_pos))
    prefill.step()
    layers_seen = sorted({layer for _, layer, _, _ in sink.sent})
    assert layers_seen == list(range(decode.config.model.arch.num_hidden_layers))
    assert_landed_equals_sent(decode, sink.sent, "bits")
    while decode.has_unfinished_requests():
        decode.step()


def test_decode_side_prefix_hit_sends_only_missing_blocks(pair):
    prefill, decode = pair
    shared = PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # the decode engine computes the shared prompt locally once: its blocks are now cached there
    decode.add_request(decode.make_request("warm", decode.tokenizer.encode(shared), params))
    while decode.has_unfinished_requests():
        decode.step()
    follow_up = shared + " In short:"
    ids = decode.tokenizer.encode(follow_up)
    sink = _Recorder(decode)
    tokens, _ = disaggregated(prefill, decode, [follow_up], params, sink, tag="hit")
    starts = {start for _, _, start, _ in sink.sent}
    assert len(starts) == 1 and (from_pos := starts.pop()) > 0 and from_pos % 16 == 0
    arch = decode.config.model.arch
    per_token_layer = 2 * arch.num_key_value_heads * arch.head_dim * 4
    assert sink.bytes_sent == (len(ids) - from_pos) * per_token_layer * arch.num_hidden_layers
    assert len(tokens["hit0"]) == 4


def test_seeded_sampling_equals_colocated(pair, llm):
    prefill, decode = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    tokens, _ = disaggregated(prefill, decode, PROMPTS[:2], params, tag="seeded")
    colocated = llm.generate(PROMPTS[:2], params)
    assert [tokens["seeded0"], tokens["seeded1"]] == [o.outputs[0].token_ids for o in colocated]


def test_incomplete_or_late_kv_is_never_used(pair):
    prefill, decode = pair
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    ids = decode.tokenizer.encode(PROMPTS[0])
    remote = decode.make_request("partial", ids, params)
    assert decode.add_remote_request(remote, deadline_s=120) == 0
    kv = torch.zeros(len(ids), *decode.kv_cache.layers[0].shape[2:])
    decode.write_remote_kv("partial", 0, 0, kv)  # only layer 0 of 30
    with pytest.raises(ValueError, match="KV incomplete"):
        decode.finish_remote_kv("partial", SampledToken(5, None))
    with pytest.raises(ValueError, match="already received"):
        decode.write_remote_kv("partial", 0, 0, kv)
    with pytest.raises(ValueError, match="does not match"):
        decode.write_remote_kv("partial", 1, 0, kv[:, :1])
    decode.abort_request("partial")
    with pytest.raises(KeyError, match="not waiting for KV"):
        decode.write_remote_kv("partial", 1, 0, kv)
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks


def test_expired_wait_recomputes_locally(pair, llm):
    _, decode = pair
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = decode.tokenizer.encode(PROMPTS[2])
    assert decode.add_remote_request(decode.make_request("late", ids, params), deadline_s=0.0) is not None
    tokens = []
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens += output.new_token_ids
    assert "late" not in decode.kv_importer
    assert tokens == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids


def test_fail_policy_ends_the_request_with_an_error_and_frees_its_blocks(pair):
    _, decode = pair
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = decode.tokenizer.encode(PROMPTS[3])
    failed_before = decode.counters.num_kv_failed
    computed_before = decode.counters.num_prompt_tokens_computed
    decode.add_remote_request(decode.make_request("late-fail", ids, params), 0.0, KVFailurePolicy.FAIL)
    (output,) = decode.step()  # the deadline has passed
    assert output.request_id == "late-fail" and output.finish_reason == "error"
    assert "did not arrive before the deadline" in output.error
    # a refused transfer under `fail`: the inbox turns it into the same error
    inbox = EngineInbox()
    decode.add_remote_request(decode.make_request("refused", ids, params), 120, KVFailurePolicy.FAIL)
    inbox.put(TransferFailed("refused", "payload checksum mismatch"))
    drained = inbox.drain_into(decode)
    assert drained.failed == {"refused": "payload checksum mismatch"}
    (output,) = drained.outputs
    assert output.finish_reason == "error" and "checksum" in output.error
    assert decode.counters.num_kv_failed - failed_before == 2
    assert decode.counters.num_prompt_tokens_computed == computed_before  # nothing was recomputed
    assert not decode.has_unfinished_requests()
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks


def test_sender_prefix_hit_still_sends_every_position_the_receiver_lacks(pair, llm, monkeypatch):
    prefill, decode = pair
    prompt = "Sender-side cache: " + PROMPTS[3]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    ids = prefill.tokenizer.encode(prompt)
    prefill.add_request(prefill.make_request("sender-warm", ids, params))  # now cached on the sender only
    while prefill.has_unfinished_requests():
        prefill.step()
    computed_before = prefill.counters.num_prompt_tokens_computed
    sink = _Recorder(decode)
    packs = []
    pack_blocks = prefill.kv_cache.pack_blocks
    monkeypatch.setattr(prefill.kv_cache, "pack_blocks", lambda *a: packs.append(a) or pack_blocks(*a))
    tokens, _ = disaggregated(prefill, decode, [prompt], params, sink, tag="sender-hit")
    cached = len(ids) // 16 * 16
    assert prefill.counters.num_prompt_tokens_computed - computed_before == len(ids) - cached
    arch = decode.config.model.arch
    assert sink.bytes_sent == len(ids) * 2 * arch.num_key_value_heads * arch.head_dim * 4 * arch.num_hidden_layers
    assert tokens["sender-hit0"] == llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0].token_ids
    # the cached positions left before the forward, every layer from one pack of their blocks
    layers = arch.num_hidden_layers
    assert len(packs) == 1 and packs[0][1:] == (0, layers) and len(packs[0][0]) == cached // 16
    assert [(layer, start, len(kv)) for _, layer, start, kv in sink.sent[:layers]] == [
        (layer, 0, cached) for layer in range(layers)
    ]
    assert all(start == cached for _, _, start, _ in sink.sent[layers:])
    # and they are what the sender's cache holds (read slot by slot, not through the pack)
    warm_table = packs[0][0]
    for _, layer, start, kv in sink.sent[:layers]:
        slots = prefill.kv_cache.slots_for(warm_table, 0, cached)
        assert torch.equal(kv, prefill.kv_cache.read_slots(layer, slots))


def test_cached_export_cuts_the_pack_at_any_position():
    """Positions [5, 37) through a table of three blocks: the packed blocks are cut to exactly
    those positions, for every layer (compared with a slot-by-slot read)."""
    from types import SimpleNamespace

    from engine.kv_cache.kv_cache import KVCache
    from engine.model_runner import ModelRunner

    arch = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=8)  # what KVCache reads
    cache = KVCache(arch, num_blocks=12, block_size=16, dtype=torch.float32)
    cache.storage.copy_(torch.randn(cache.storage.shape))
    runner = ModelRunner(model=None, kv_cache=cache, backend=None)
    got = []
    runner.on_layer_kv = lambda *args: got.append(args)
    table = [7, 3, 11]
    runner._export_cached(ScheduledSeq("cut", [0], 37, table, None, None), 5, 37)
    assert [(rid, layer, start) for rid, layer, start, _ in got] == [("cut", i, 5) for i in range(3)]
    for _, layer, _, kv in got:
        assert torch.equal(kv, cache.read_slots(layer, cache.slots_for(table, 5, 37)))
