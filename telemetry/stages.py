"""The workers' stages of one request (DESIGN.md): durations for the router's histograms and,
with tracing on, spans under the router's request span.

Every duration comes from one process's monotonic clock; the prefill worker's two durations
travel with the first token. So nothing depends on two machines' clocks agreeing, and on the
decode worker the stages of a request add up to exactly the time it spent there:

    remote prefill:  decode_queue (admission) | prefill_queue | prefill | kv_transfer | decode_queue (join) | decode
                     received ........... Prefill call sent ............ KV landed .. joined the batch .. finished
    local prefill:   prefill_queue | prefill | decode
                     received .. scheduled .. first token .. finished

kv_transfer is what the KV transfer added after the prompt's last layer was computed (the
unhidden tail; layer-wise sends overlap the prefill), plus the Prefill call's one-way trip.
"""

from __future__ import annotations

from opentelemetry import trace

from engine.request import RequestTimes
from proto import worker_pb2 as pb
from telemetry.tracing import Tracing, unix_ns


def decode_stage_times(received: float, prefill_sent: float | None, times: RequestTimes, remote: bool) -> pb.StageTimes:
    """Stages of a request that ended on this decode worker. ``remote``: its KV came from a
    prefill worker (not recomputed here)."""
    finished = times.finished if times.finished is not None else received
    if remote and times.kv_landed is not None and times.first_token is not None:
        sent = prefill_sent if prefill_sent is not None else received
        landed, joined = times.kv_landed, times.first_token
        tail = max(0.0, (landed - sent) - times.sender_queue_s - times.sender_prefill_s)
        first_chunk = times.kv_first_chunk if times.kv_first_chunk is not None else landed
        return pb.StageTimes(prefill_queue=times.sender_queue_s, prefill=times.sender_prefill_s, kv_transfer=tail,
                             decode_queue=max(0.0, sent - received) + max(0.0, joined - landed),
                             decode=max(0.0, finished - joined), remote_prefill=True,
                             kv_transfer_total=max(0.0, landed - first_chunk), kv_bytes=times.kv_bytes)
    scheduled = times.scheduled if times.scheduled is not None else finished
    first = times.first_token if times.first_token is not None else finished
    return pb.StageTimes(prefill_queue=max(0.0, scheduled - received), prefill=max(0.0, first - scheduled),
                         decode=max(0.0, finished - first))


def decode_spans(tracing: Tracing, parent, received: float, prefill_sent: float | None, times: RequestTimes,
                 stages: pb.StageTimes, attributes: dict, error: str | None = None) -> None:
    """The decode worker's spans of one request (the prefill worker makes its own)."""
    finished = times.finished if times.finished is not None else received
    if stages.remote_prefill:
        sent = prefill_sent if prefill_sent is not None else received
        landed, joined = times.kv_landed, times.first_token
        tracing.span_at("decode_queue", parent, unix_ns(received), unix_ns(sent),
                        {**attributes, "tandem.queue": "admission"})
        tracing.span_at("kv_transfer", parent, unix_ns(landed - stages.kv_transfer), unix_ns(landed),
                        {**attributes, "tandem.kv_bytes": stages.kv_bytes,
                         "tandem.kv_transfer_total_s": stages.kv_transfer_total})
        tracing.span_at("decode_queue", parent, unix_ns(landed), unix_ns(joined),
                        {**attributes, "tandem.queue": "join"})
        tracing.span_at("decode", parent, unix_ns(joined), unix_ns(finished), attributes, error)
        return
    scheduled = received + stages.prefill_queue
    first = scheduled + stages.prefill
    tracing.span_at("prefill_queue", parent, unix_ns(received), unix_ns(scheduled), attributes)
    tracing.span_at("prefill", parent, unix_ns(scheduled), unix_ns(first), attributes)
    tracing.span_at("decode", parent, unix_ns(first), unix_ns(finished), attributes, error)


def prefill_spans(tracing: Tracing, parent, received: float, times: RequestTimes, layer_sends, attributes: dict,
                  error: str | None = None) -> None:
    """The prefill worker's spans of one request: its queue, its prefill, and the KV sends
    (one span per layer, under one kv_send span; they overlap the prefill)."""
    scheduled = times.scheduled if times.scheduled is not None else received
    done = times.first_token if times.first_token is not None else (times.finished or scheduled)
    tracing.span_at("prefill_queue", parent, unix_ns(received), unix_ns(scheduled), attributes)
    tracing.span_at("prefill", parent, unix_ns(scheduled), unix_ns(done), attributes, error)
    sends = list(layer_sends)
    if not sends:
        return
    start, end = min(s.started for s in sends), max(s.ended for s in sends)
    total = tracing.span_at("kv_send", parent, unix_ns(start), unix_ns(end),
                            {**attributes, "tandem.kv_bytes": sum(s.num_bytes for s in sends),
                             "tandem.layers_sent": len(sends)})
    inner = trace.set_span_in_context(total)
    for send in sends:
        tracing.span_at("kv_send.layer", inner, unix_ns(send.started), unix_ns(send.ended),
                        {"tandem.layer": send.layer, "tandem.start_pos": send.start_pos,
                         "tandem.kv_bytes": send.num_bytes})
