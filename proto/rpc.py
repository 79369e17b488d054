"""The gRPC conventions every tandem process shares, whichever service it serves or calls:
message size limits, the cluster secret's metadata key, and the trailing metadata by which a
worker tells the router why a call failed."""

from __future__ import annotations

import enum

SECRET_METADATA_KEY = "x-tandem-cluster-secret"  # every worker RPC carries the cluster secret here
MAX_MESSAGE_BYTES = 4 << 20  # any one message; a KV frame's payload is at most a quarter of it
_MESSAGE_LIMITS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Every channel between tandem's processes pings a connection that has gone quiet, so that a
# peer that froze (SIGSTOP, a full stop of its host) or was cut off fails the calls on it
# within about 15 s instead of holding them until their deadlines.
CHANNEL_OPTIONS = _MESSAGE_LIMITS + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),  # keep pinging a stream that waits on a long prefill
]
# ... and every worker server allows those pings (by default a server answers pings more often
# than every 5 minutes without data with GOAWAY "too_many_pings"), and pings its callers in
# turn: a worker cut off from its router (a partition) ends the streams it could no longer
# deliver, and frees their KV blocks, in about 15 s instead of generating into them until
# their max_tokens.
SERVER_OPTIONS = _MESSAGE_LIMITS + [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_ping_strikes", 0),
]
ERROR_SCOPE_KEY = "tandem-error-scope"  # trailing metadata of a failed Generate: an engine ErrorScope value
ERROR_PARAM_KEY = "tandem-error-param"  # trailing metadata of an INVALID_ARGUMENT: the field at fault


def secret_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that authenticates a call to a worker."""
    return ((SECRET_METADATA_KEY, secret),)


class Role(enum.StrEnum):
    """A worker's role: what it reports in Stats (``WorkerStats.role``) and what the router
    names its pools by."""

    PREFILL = "prefill"
    DECODE = "decode"
