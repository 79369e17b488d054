"""KV transfer over real gRPC on loopback: bytes land bit for bit, corrupt chunks and
unauthenticated senders are refused, and the decode engine never runs on bad KV."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.remote_kv import KVExport, prefill_side_params
from kv_transfer.grpc_transport import GrpcKVReceiver, GrpcKVSink
from kv_transfer.inbox import EngineInbox
from kv_transfer.wire import CorruptChunkError, decode_chunk, encode_layer, parse_frame
from tests.conftest import make_engine_pair
from tests.kv_transfer.helpers import RecordsSent, assert_landed_equals_sent
from worker_runtime.server import ServerConfig, WorkerServer

SECRET = "test-cluster-secret"
PROMPTS = [
    "The quick brown fox",
    "Explain, step by step, how photosynthesis converts light into chemical energy in plants. " * 3,
]


@pytest.fixture(scope="module")
def engines(smollm_dir):
    return make_engine_pair(smollm_dir)


@pytest.fixture(scope="module")
def server(engines):
    _, decode = engines
    inbox = EngineInbox()
    cache = decode.kv_cache.layers[0]
    receiver = GrpcKVReceiver(inbox, cache.dtype, tuple(cache.shape[2:]), lambda: grpc_server.address)
    # what a decode worker serves KV on: its grpc.aio server, the cluster secret checked per call
    grpc_server = WorkerServer(ServerConfig("127.0.0.1", 0, SECRET),
                               lambda server: server.add_generic_rpc_handlers((receiver.handler(),)))
    grpc_server.start()
    yield inbox, receiver.kv_target
    grpc_server.stop()


class RecordingSink(RecordsSent, GrpcKVSink):
    """A sender on a faulty link: one payload bit of the corrupt request's layer 7 flips after
    its checksum was computed."""

    def _frames(self):
        for data in super()._frames():
            yield self.corrupt(data, layer=7)


def run_transfer(engines, inbox, sink, prompts, params, tag):
    prefill, decode = engines
    ids = {}
    for index, prompt in enumerate(prompts):
        request_id = f"{tag}{index}"
        ids[request_id] = decode.tokenizer.encode(prompt)
        remote = decode.make_request(request_id, ids[request_id], params)
        from_pos = decode.add_remote_request(remote, deadline_s=120)
        prefill.add_request(prefill.make_request(request_id, ids[request_id], prefill_side_params(params, remote.seed)),
                            KVExport(sink, from_pos))
    while prefill.has_unfinished_requests():
        prefill.step()
    reply = sink.finish()
    drained = inbox.drain_into(decode)
    return ids, reply, drained


def finish_decoding(decode, drained):
    tokens = {o.request_id: list(o.new_token_ids) for o in drained.outputs}
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    return tokens


def test_grpc_transfer_is_bit_exact_and_decodes_like_colocated(engines, server, llm):
    prefill, decode = engines
    inbox, target = server
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    sink = RecordingSink(target, SECRET, max_chunk_bytes=4096)  # small chunks: many per layer
    processed_before = decode.runner.num_tokens_processed
    ids, reply, drained = run_transfer(engines, inbox, sink, PROMPTS, params, "g")
    assert sink.error is None and dict(reply.rejected) == {}
    assert reply.bytes_received == sink.bytes_sent == sum(kv.numel() * 4 for *_, kv in sink.sent)
    assert reply.chunks_received > len(sink.sent)  # layers really were split into chunks
    assert_landed_equals_sent(decode, sink.sent)  # what landed is what was computed
    tokens = finish_decoding(decode, drained)
    assert decode.runner.num_tokens_processed - processed_before == len(PROMPTS) * (8 - 1)  # no local prefill
    reference = llm.generate([{"prompt_token_ids": ids[f"g{i}"]} for i in range(len(PROMPTS))], params)
    assert [tokens[f"g{i}"] for i in range(len(PROMPTS))] == [r.outputs[0].token_ids for r in reference]


def test_corrupt_chunk_is_refused_and_request_recomputed(engines, server, llm):
    prefill, decode = engines
    inbox, target = server
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    sink = RecordingSink(target, SECRET, corrupt_request="c1")
    processed_before = decode.runner.num_tokens_processed
    fresh = ["Unseen opening. " + p for p in PROMPTS]  # nothing of these is cached anywhere yet
    ids, reply, drained = run_transfer(engines, inbox, sink, fresh, params, "c")
    assert "checksum" in reply.rejected["c1"] and "c0" not in reply.rejected
    assert "checksum" in drained.failed["c1"]
    assert "c1" not in decode.kv_importer
    tokens = finish_decoding(decode, drained)
    # c1 was prefilled locally (never on the corrupt KV), c0 used its transfer
    assert decode.runner.num_tokens_processed - processed_before == len(ids["c1"]) + 2 * (5 - 1)
    reference = llm.generate([{"prompt_token_ids": ids["c0"]}, {"prompt_token_ids": ids["c1"]}], params)
    assert [tokens["c0"], tokens["c1"]] == [r.outputs[0].token_ids for r in reference]


def test_sender_without_the_secret_is_rejected(engines, server):
    prefill, decode = engines
    inbox, target = server
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    sink = GrpcKVSink(target, "wrong-secret")
    ids, reply, drained = run_transfer(engines, inbox, sink, PROMPTS[:1], params, "x")
    assert reply is None and sink.error.code().name == "UNAUTHENTICATED"
    assert len(inbox) == 0 and drained.outputs == []
    assert decode.kv_importer._states["x0"].received.sum() == 0  # nothing was written
    decode.abort_request("x0")
    assert decode.block_pool.num_free_blocks == decode.block_pool.num_blocks


def test_wire_format_round_trip_and_validation():
    kv = torch.randn(37, 6, 64).to(torch.bfloat16)
    frames = list(encode_layer("r", 3, 100, kv, max_chunk_bytes=10 * 6 * 64 * 2))
    parsed = [parse_frame(f) for f in frames]
    assert [m.chunk.num_tokens for m, _ in parsed] == [10, 10, 10, 7]
    parts = [decode_chunk(m.chunk, payload, torch.bfloat16, (6, 64)) for m, payload in parsed]
    assert [p.start_pos for p in parts] == [100, 110, 120, 130]
    assert torch.equal(torch.cat([p.kv for p in parts]), kv)
    message, payload = parsed[0]
    with pytest.raises(CorruptChunkError, match="dtype"):
        decode_chunk(message.chunk, payload, torch.float32, (6, 64))
    with pytest.raises(CorruptChunkError, match="shape"):
        decode_chunk(message.chunk, payload, torch.bfloat16, (4, 64))
    with pytest.raises(CorruptChunkError, match="bytes"):
        decode_chunk(message.chunk, payload[:-2], torch.bfloat16, (6, 64))
    with pytest.raises(CorruptChunkError, match="length"):
        parse_frame(b"\xff\xff\x00\x00" + frames[0][4:])
    with pytest.raises(CorruptChunkError):
        parse_frame(b"\x01")


def test_first_layer_arrives_before_prefill_finishes(engines, server):
    """Layer-wise overlap is real: the receiver holds layer 0's KV while the sender's
    forward pass is still running later layers."""
    import time

    prefill, decode = engines
    inbox, target = server
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    arrival_times: list[float] = []
    original_put = inbox.put

    def timed_put(item):
        arrival_times.append(time.perf_counter())
        original_put(item)

    inbox.put = timed_put
    try:
        sink = GrpcKVSink(target, SECRET)
        prompt = " ".join(f"w{i}" for i in range(200))  # a long prompt (~700 tokens): a slow forward
        ids = decode.tokenizer.encode(prompt)
        remote = decode.make_request("overlap", ids, params)
        from_pos = decode.add_remote_request(remote, deadline_s=120)
        prefill.add_request(prefill.make_request("overlap", ids, prefill_side_params(params, remote.seed)),
                            KVExport(sink, from_pos))
        prefill.step()
        step_done = time.perf_counter()
        sink.finish()
    finally:
        inbox.put = original_put
    assert arrival_times and arrival_times[0] < step_done  # received during the forward pass
    drained = inbox.drain_into(decode)
    tokens = finish_decoding(decode, drained)
    assert len(tokens["overlap"]) == 2
