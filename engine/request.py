"""A request inside the engine, and the states it moves through."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.outputs import FinishReason, PositionLogprobs
from engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; its prompt KV will be computed here
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks reserved, KV arriving from a prefill worker
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; will recompute its tokens when readmitted
    FINISHED_STOPPED = "finished_stopped"  # EOS, stop token id or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class ErrorScope(enum.Enum):
    """Whose fault a failed request's error is: workers turn it into a status, and the router
    decides from it whether another worker could do better (DESIGN.md's failure rules)."""

    REQUEST = "request"  # its own sampling, stop handling or detokenizing; the step went on for the rest
    STEP = "step"  # the forward pass failed, and with it every request of the batch
    KV_TRANSFER = "kv_transfer"  # its prompt's remote KV failed or came late (fail policy)
    ENGINE = "engine"  # the engine loop died


@dataclass(slots=True)
class RequestTimes:
    """When a request passed each point, on this process's ``time.monotonic()`` clock (None:
    not yet). Workers turn these into stage latencies and trace spans."""

    scheduled: float | None = None  # first scheduled to compute its prompt here
    first_token: float | None = None  # its first token was emitted here
    finished: float | None = None
    # decode role, remote prefill: when its KV landed, and what the prefill worker measured
    kv_first_chunk: float | None = None  # the first KV chunk reached this process
    kv_landed: float | None = None  # the transfer's last message (the first token) reached this process
    sender_queue_s: float = 0.0  # on the prefill worker: Prefill call received until its prefill began
    sender_prefill_s: float = 0.0  # on the prefill worker: prefill began until the first token
    kv_bytes: int = 0  # KV bytes received for it


@dataclass(slots=True)
class Request:
    """One sequence being generated (a request with n > 1 becomes n of these).

    Token accounting (vLLM v1 style): the sequence is prompt + output tokens; the first
    ``num_computed_tokens`` of them have KV in the cache. Each step schedules some of the
    rest; when all are computed, the step also samples the next token.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # sampling seed: the caller's, or one drawn for this request
    eos_token_ids: tuple[int, ...]  # empty when ignore_eos
    max_tokens: int  # resolved against max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix cache / remote)
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)  # per output token, if asked
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    num_preemptions: int = 0
    cache_salt: str | None = None  # isolates this request's prefix-cache blocks (tenant key)
    priority: int = 0  # the priority scheduling policy runs lower values first (vLLM's convention)
    kv_export_from: int | None = None  # prefill role: export KV of positions from here on
    kv_recomputed: bool = False  # decode role: its remote KV failed, the prompt is computed here
    block_hashes: list[bytes] = field(default_factory=list)  # prefix digests of full blocks
    times: RequestTimes = field(default_factory=RequestTimes)

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need logits for every prompt position, so nothing is skipped."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.sampling_params.prompt_logprobs is not None
