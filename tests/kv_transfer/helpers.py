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
