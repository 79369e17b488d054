"""KV transfer over torch.distributed (gloo here; NCCL payloads where both ends are on CUDA):
bit-exact, authenticated, checked — between threads of this process and between two real
processes."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from engine import SamplingParams
from engine.remote_kv import KVExport, prefill_side_params
from kv_transfer import torch_dist
from kv_transfer.inbox import EngineInbox
from kv_transfer.torch_dist import (
    TorchDistKVReceiver,
    TorchDistKVSink,
    payload_backend,
    payload_checksum,
)
from kv_transfer.wire import chunk_header, frame
from tests.conftest import make_engine_pair
from tests.kv_transfer.helpers import RecordsSent, assert_landed_equals_sent

SECRET = "gloo-test-secret"
PROMPTS = ["A gloo transfer carries this prompt", "Another prompt, with a few more tokens in it than the first one"]


@pytest.fixture(scope="module")
def engines(smollm_dir):
    return make_engine_pair(smollm_dir)


def receiver_for(decode, secret=SECRET, timeout_s: float = 30):
    inbox = EngineInbox()
    cache = decode.kv_cache.layers[0]
    return inbox, TorchDistKVReceiver(inbox, secret, cache.dtype, tuple(cache.shape[2:]), timeout_s=timeout_s)


class RecordingSink(RecordsSent, TorchDistKVSink):
    """A sender on a faulty link: one bit of the corrupt request's layer-3 payload flips after
    its header's checksum was computed (that layer fits one chunk)."""

    def _send_layer(self, pair, item):
        if item.request_id != self.corrupt_request or item.layer != 3:
            return super()._send_layer(pair, item)
        payload = item.kv.contiguous().view(torch.uint8).reshape(-1)
        header = chunk_header(item.request_id, item.layer, item.start_pos, item.kv, pair.checksum(payload))
        damaged = payload.clone()
        damaged[11] ^= 0x40
        pair.send_frame(torch.frombuffer(bytearray(frame(header)), dtype=torch.uint8))
        pair.send_payload(damaged)


def reserve(decode, prompts, params, tag):
    plan = []
    for index, prompt in enumerate(prompts):
        ids = decode.tokenizer.encode(prompt)
        remote = decode.make_request(f"{tag}{index}", ids, params)
        plan.append((remote.request_id, ids, decode.add_remote_request(remote, deadline_s=120), remote.seed))
    return plan


def decode_all(decode, inbox):
    drained = inbox.drain_into(decode)
    tokens = {o.request_id: list(o.new_token_ids) for o in drained.outputs}
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens, drained


def test_gloo_transfer_between_threads_decodes_like_colocated(engines, llm):
    prefill, decode = engines
    _transfer_and_compare(prefill, decode, llm, "t")


def test_the_gpu_checksum_path_over_gloo(engines, llm, monkeypatch):
    """The checksum NCCL pairs use (computed where the bytes are), on the same transfer."""
    monkeypatch.setitem(torch_dist.CHECKSUMS, "gloo", payload_checksum)
    prefill, decode = engines
    _transfer_and_compare(prefill, decode, llm, "g")


def test_payload_backend_and_checksum():
    assert payload_backend("cuda", "cuda") == "nccl"
    assert payload_backend("cuda", "cpu") == payload_backend("cpu", "cuda") == payload_backend("cpu", "cpu") == "gloo"
    generator = torch.Generator().manual_seed(3)
    for size in (1, 3, 4, 1001, 4096):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        raw = bytes(data.tolist()) + bytes(-size % 4)
        words = [int.from_bytes(raw[i:i + 4], "little", signed=True) for i in range(0, len(raw), 4)]
        s1 = sum(words) % 2**64
        s2 = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
        assert payload_checksum(data) == (s2 * 0x9E3779B97F4A7C15 + s1 + len(words)) % 2**64
    data = torch.randint(0, 256, (64,), dtype=torch.uint8, generator=generator)
    flipped = data.clone()
    flipped[17] ^= 1
    swapped = data.view(torch.int32)[[1, 0, *range(2, 16)]].view(torch.uint8)
    assert len({payload_checksum(data), payload_checksum(flipped), payload_checksum(swapped)}) == 3


def test_each_end_binds_gloo_where_its_peer_reaches_it():
    """A sender's gloo sockets are on its route to the receiver (not on what the hostname
    resolves to, which another node may not reach); tests/multinode runs it across a link."""
    from kv_transfer.torch_dist import local_address_to

    assert local_address_to("127.0.0.1") == "127.0.0.1"
    assert local_address_to("localhost") in ("127.0.0.1", "::1")


def _transfer_and_compare(prefill, decode, llm, tag):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    inbox, receiver = receiver_for(decode)
    sink = RecordingSink(receiver.address, SECRET, max_chunk_bytes=8192)
    for request_id, ids, from_pos, seed in reserve(decode, [f"[{tag}] {p}" for p in PROMPTS], params, tag):
        prefill.add_request(prefill.make_request(request_id, ids, prefill_side_params(params, seed)), KVExport(sink, from_pos))
    while prefill.has_unfinished_requests():
        prefill.step()
    assert sink.finish() is None
    stats = receiver.join(30)
    assert stats.error is None and stats.rejected == {} and stats.backend == sink.backend == "gloo"
    assert stats.bytes_received == sink.bytes_sent == sum(kv.numel() * 4 for *_, kv in sink.sent)
    tokens, drained = decode_all(decode, inbox)
    assert drained.failed == {}
    reference = llm.generate([f"[{tag}] {p}" for p in PROMPTS], params)
    assert [tokens[f"{tag}0"], tokens[f"{tag}1"]] == [r.outputs[0].token_ids for r in reference]


@pytest.mark.parametrize("checksum", ["xxh3", "gpu"])
def test_gloo_landed_kv_equals_sent_and_corruption_is_refused(engines, monkeypatch, checksum):
    if checksum == "gpu":  # the NCCL pairs' checksum, here over gloo
        monkeypatch.setitem(torch_dist.CHECKSUMS, "gloo", payload_checksum)
    prefill, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    inbox, receiver = receiver_for(decode)
    sink = RecordingSink(receiver.address, SECRET, corrupt_request="k1")
    fresh = [f"Bits for gloo ({checksum}): " + p for p in PROMPTS]
    for request_id, ids, from_pos, seed in reserve(decode, fresh, params, "k"):
        prefill.add_request(prefill.make_request(request_id, ids, prefill_side_params(params, seed)), KVExport(sink, from_pos))
    while prefill.has_unfinished_requests():
        prefill.step()
    sink.finish()
    stats = receiver.join(30)
    assert "checksum" in stats.rejected["k1"] and "k0" not in stats.rejected
    drained = inbox.drain_into(decode)
    assert "k1" in drained.failed and [o.request_id for o in drained.outputs] == ["k0"]
    assert_landed_equals_sent(decode, sink.sent, "k0")
    while decode.has_unfinished_requests():
        decode.step()


def test_gloo_sender_without_the_secret_is_refused(engines):
    _, decode = engines
    inbox, receiver = receiver_for(decode)
    sink = TorchDistKVSink(receiver.address, "not-the-secret", timeout_s=5)
    sink.send_layer("nobody", 0, 0, torch.zeros(4, *decode.kv_cache.layers[0].shape[2:]))
    sink.finish()
    stats = receiver.join(30)
    assert "secret" in stats.error and stats.bytes_received == 0 and len(inbox) == 0


class _OversizedHeaderSink(TorchDistKVSink):
    """Sends layer 0 as it is, then announces a layer-1 chunk far larger than any receiver accepts."""

    def _send_layer(self, pair, item):
        if item.layer == 0:
            return super()._send_layer(pair, item)
        header = chunk_header(item.request_id, item.layer, item.start_pos, item.kv, 0)
        header.chunk.payload_bytes = 1 << 40
        pair.send_frame(torch.frombuffer(bytearray(frame(header)), dtype=torch.uint8))


def test_a_chunk_larger_than_the_limit_ends_the_pair_and_fails_its_requests(engines):
    _, decode = engines
    inbox, receiver = receiver_for(decode)
    sink = _OversizedHeaderSink(receiver.address, SECRET, timeout_s=10)
    shape = decode.kv_cache.layers[0].shape[2:]
    sink.send_layer("big", 0, 0, torch.ones(2, *shape))
    sink.send_layer("big", 1, 0, torch.ones(2, *shape))
    sink.finish(30)
    stats = receiver.join(30)
    assert "payload bytes (limit" in stats.error and stats.chunks_received == 1
    arrivals = inbox._items
    assert [type(a).__name__ for a in arrivals] == ["KVArrival", "TransferFailed"]
    assert arrivals[1].request_id == "big" and "ended early" in arrivals[1].reason


def _prefill_process(model_dir, address, plan, params, result_queue):
    """Child process: a prefill engine that streams its KV to the parent over gloo."""
    from engine import LLM

    torch.set_num_threads(1)
    core = LLM(model=model_dir, dtype="float32", num_kv_blocks=128, max_model_len=512).engine_core
    sink = TorchDistKVSink(tuple(address), SECRET, timeout_s=60)
    for request_id, ids, from_pos, seed in plan:
        core.add_request(core.make_request(request_id, ids, prefill_side_params(params, seed)), KVExport(sink, from_pos))
    while core.has_unfinished_requests():
        core.step()
    result_queue.put((sink.finish(), sink.bytes_sent))


def test_gloo_transfer_between_processes(engines, smollm_dir, llm):
    _, decode = engines
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = ["Across processes: " + p for p in PROMPTS]
    # the receiver's wait includes the child's start: spawning Python and loading the model, which
    # took over 30 s on a loaded 2-core CI machine
    inbox, receiver = receiver_for(decode, timeout_s=150)
    plan = reserve(decode, prompts, params, "p")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_prefill_process, args=(str(smollm_dir), list(receiver.address), plan, params, results))
    child.start()
    error, bytes_sent = results.get(timeout=180)
    child.join(60)
    assert child.exitcode == 0 and error is None
    stats = receiver.join(30)
    assert stats.error is None and stats.bytes_received == bytes_sent > 0
    processed_before = decode.runner.num_tokens_processed
    tokens, drained = decode_all(decode, inbox)
    assert drained.failed == {}
    assert decode.runner.num_tokens_processed - processed_before == len(prompts) * (5 - 1)
    reference = llm.generate(prompts, params)
    assert [tokens["p0"], tokens["p1"]] == [r.outputs[0].token_ids for r in reference]
