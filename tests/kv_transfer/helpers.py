"""Checks shared by the transport tests."""

from __future__ import annotations

import torch


def assert_landed_equals_sent(decode, sent, request_id: str | None = None) -> int:
    """Every (request, layer, start, kv) recorded by a sender is, bit for bit, what now sits
    in the decode engine's blocks for those positions. Returns how many pieces were checked."""
    checked = 0
    for rid, layer, start, kv in sent:
        if request_id is not None and rid != request_id:
            continue
        table = decode.kv_manager.block_table(rid)
        landed = decode.kv_cache.read_slots(layer, decode.kv_cache.slots_for(table, start, start + len(kv)))
        assert torch.equal(landed, kv), f"{rid} layer {layer} from {start}: landed KV differs from sent"
        checked += 1
    assert checked, "no KV was recorded as sent"
    return checked


class RecordsSent:
    """Mixin for a KVSink under test: keeps a copy of every layer it is asked to send, and
    names a request whose frames ``corrupt`` will damage (see ``corrupt_payload_bit``)."""

    def __init__(self, *args, corrupt_request: str | None = None, **kwargs):
        self.sent: list[tuple[str, int, int, torch.Tensor]] = []
        self.corrupt_request = corrupt_request
        super().__init__(*args, **kwargs)

    def send_layer(self, request_id, layer, start_pos, kv):
        self.sent.append((request_id, layer, start_pos, kv.clone()))
        super().send_layer(request_id, layer, start_pos, kv)

    def corrupt(self, data: bytes, layer: int) -> bytes:
        """Flip one payload bit of the corrupt request's frame for ``layer``; the header's
        checksum stays the one computed for the original bytes."""
        from kv_transfer.wire import parse_frame

        message, payload = parse_frame(data)
        if message.chunk.request_id != self.corrupt_request or message.chunk.layer != layer:
            return data
        damaged = bytearray(data)
        damaged[len(data) - payload.nbytes + 11] ^= 0x40
        return bytes(damaged)


def disaggregated(prefill, decode, prompts, params, sink=None, tag="r"):
    """Run prompts (text or token ids) prefill-on-one, decode-on-the-other, through the
    in-process transport; returns ({request id: token ids}, the sink)."""
    from engine.remote_kv import KVExport, prefill_side_params
    from kv_transfer.inprocess import InProcessKVSink

    sink = sink or InProcessKVSink(decode)
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        ids = decode.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        request_id = f"{tag}{index}"
        remote = decode.make_request(request_id, ids, params)
        from_pos = decode.add_remote_request(remote, deadline_s=120)
        assert from_pos is not None
        local = prefill.make_request(request_id, ids, prefill_side_params(params, remote.seed))
        prefill.add_request(local, KVExport(sink, from_pos))
        tokens[request_id] = []
    while prefill.has_unfinished_requests():
        prefill.step()  # all prompts prefilled together, KV exported after each layer
    assert not sink.errors, sink.errors
    for output in sink.first_outputs:
        tokens[output.request_id] += output.new_token_ids
    while decode.has_unfinished_requests():
        for output in decode.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens, sink
