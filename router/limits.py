"""What one request may ask of the server, checked before it is admitted. Each limit is a
server flag (README's API section lists them with their defaults); a request over one gets a
400 whose ``param`` names the field. Checks that need the tokenized prompt (its length
against the context) run after tokenizing, in router/openai_api.py."""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.errors import APIError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # X-Request-Id and the gRPC request_id


@dataclass(frozen=True, slots=True)
class RequestLimits:
    max_n: int = 16  # --max-n: choices per prompt
    max_prompts: int = 64  # --max-prompts-per-request: prompts in one /v1/completions body
    max_stop: int = 16  # --max-stop-strings: entries in "stop"
    max_stop_len: int = 256  # --max-stop-string-len: characters per stop string
    max_input_chars: int = 1 << 20  # --max-input-chars: characters of text (prompts, messages) before tokenizing

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts", "max_stop", "max_stop_len", "max_input_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def check_request_id(request_id: str, param: str) -> str:
    """A client's request id is kept for its logs, headers and traces: printable and short."""
    if not REQUEST_ID.fullmatch(request_id):
        shown = request_id[:40] + ("..." if len(request_id) > 40 else "")
        raise APIError(400, f"{param} must be 1-128 characters of A-Z a-z 0-9 . _ : - (got {shown!r})", param)
    return request_id


def check_sequences(limits: RequestLimits, num_prompts: int, n: int, max_queue: int) -> int:
    """The request's sequences (prompts x n), which admission counts; returns that number."""
    if num_prompts > limits.max_prompts:
        raise APIError(400, f"{num_prompts} prompts in one request; this server allows at most {limits.max_prompts} "
                            "(--max-prompts-per-request)", "prompt")
    if n > limits.max_n:
        raise APIError(400, f"n is {n}; this server allows at most {limits.max_n} (--max-n)", "n")
    num_sequences = num_prompts * n
    if num_sequences > max_queue:
        raise APIError(400, f"{num_prompts} prompts x n={n} is {num_sequences} sequences; this server admits at most "
                            f"{max_queue} at once (--max-queue)", "n")
    return num_sequences


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"{param}: token ids must be in [0, {vocab_size}); got {bad[:5]}", param)


def check_stop(limits: RequestLimits, stop: str | list[str] | None) -> None:
    stops = [stop] if isinstance(stop, str) else list(stop or ())
    if len(stops) > limits.max_stop:
        raise APIError(400, f"{len(stops)} stop strings; this server allows at most {limits.max_stop} "
                            "(--max-stop-strings)", "stop")
    for text in stops:
        if not text:
            raise APIError(400, "stop strings must not be empty", "stop")
        if len(text) > limits.max_stop_len:
            raise APIError(400, f"a stop string of {len(text)} characters; this server allows at most "
                                f"{limits.max_stop_len} (--max-stop-string-len)", "stop")


def check_input_chars(limits: RequestLimits, texts: list[str], param: str) -> None:
    """Before tokenizing: text this long could not fit the context anyway, and tokenizing it
    would only cost the server time."""
    total = sum(len(text) for text in texts)
    if total > limits.max_input_chars:
        raise APIError(400, f"{total} characters of input; this server tokenizes at most {limits.max_input_chars} "
                            "per request (--max-input-chars)", param)
