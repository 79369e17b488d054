"""The gRPC conventions every tandem process shares, whichever service it serves or calls:
message size limits, the cluster secret's metadata key, and the trailing metadata by which a
worker tells the router why a call failed."""

from __future__ import annotations

import enum

SECRET_METADATA_KEY = "x-tandem-cluster-secret"  # every worker RPC carries the cluster secret here
MAX_MESSAGE_BYTES = 4 << 20  # any one message; a KV frame's payload is at most a quarter of it
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
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
