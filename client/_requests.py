"""Request building and retry rules shared by the sync and asyncio clients."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from client.params import SamplingParams
from proto import generation_pb2 as pb

Prompt = str | Sequence[int]  # text, or token ids
Messages = Sequence[dict]  # [{"role": ..., "content": ...}]
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.max_receive_message_length", 16 << 20),
]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """How the server handles one request, apart from its sampling parameters."""

    n: int = 1  # choices
    request_id: str | None = None  # None: a fresh one (a client retrying sends the same)
    priority: int | None = None  # lower runs first (server under --scheduling-policy priority); None: the class's
    traffic_class: str | None = None  # one of the server's --traffic-classes; None: "default"
    cache_salt: str | None = None  # prefix-cache blocks are shared only between requests of the same salt


def generation_request(model: str, prompt: Prompt | None, messages: Messages | None, params: SamplingParams | None,
                       options: RequestOptions) -> pb.GenerationRequest:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt (text or token ids) and messages")
    request = pb.GenerationRequest(model=model, n=options.n, request_id=options.request_id or uuid.uuid4().hex,
                                   params=(params or SamplingParams()).to_proto(),
                                   traffic_class=options.traffic_class or "", cache_salt=options.cache_salt or "")
    if options.priority is not None:
        request.priority = options.priority
    if messages is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(int(t) for t in prompt)
    return request


def tokenize_request(model: str, text: str | None, messages: Messages | None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise ValueError("give exactly one of text and messages")
    request = pb.TokenizeRequest(model=model)
    if messages is not None:
        request.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    else:
        request.text = text
    return request


def metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def credentials(root_certificates: bytes | None, tls: bool):
    """Channel credentials when TLS is asked for (root certificates, or the system's)."""
    if root_certificates is None and not tls:
        return None
    return grpc.ssl_channel_credentials(root_certificates)


def should_retry(error: grpc.RpcError, received_any: bool, attempt: int, max_retries: int) -> bool:
    """Only UNAVAILABLE, only before anything arrived (nothing was generated for the caller)."""
    return not received_any and attempt < max_retries and error.code() == grpc.StatusCode.UNAVAILABLE


def backoff_s(attempt: int) -> float:
    return min(2.0, 0.2 * 2**attempt)
