"""What the offline API returns, with vLLM's class and field names."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a request ended, spelled as vLLM and OpenAI spell it: the ``finish_reason`` of every
    engine output, worker stream chunk and API response."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled: client gone, aborted, drained
    ERROR = "error"  # failed: the output's error says why and whose fault it was


@dataclass(frozen=True, slots=True)
class Logprob:
    logprob: float  # natural log of the token's probability under the model's raw logits
    rank: int  # 1 = most likely token
    decoded_token: str | None  # the token's text on its own


# one dict per position: token_id -> Logprob (the top-N plus the chosen token)
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the chosen tokens' logprobs (when logprobs asked)
    logprobs: list[PositionLogprobs] | None
    finish_reason: FinishReason | None = None  # None: running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None  # first position is None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused instead of computed
