"""The typed contracts between the scheduler, the model runner and the engine core."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SamplingInput:
    """What the sampler needs to pick one sequence's next token."""

    params: SamplingParams
    seed: int  # with `position`, the only source of randomness
    position: int  # position in the sequence of the token being sampled
    prompt_token_ids: list[int]  # read-only view, for repetition_penalty
    output_token_ids: list[int]  # read-only view, for penalties and min_tokens
    eos_token_ids: tuple[int, ...]  # blocked while min_tokens is not reached


@dataclass(frozen=True, slots=True)
class PromptLogprobsInput:
    """Score prompt tokens: the logits at chunk rows [row_offset, row_offset + len(targets))
    (positions p) score prompt token p + 1 (the targets)."""

    num_top: int  # N most likely tokens to report per position
    row_offset: int  # first chunk row to score (> 0 when earlier rows were scored before a preemption)
    target_token_ids: list[int]  # prompt tokens at positions start_pos + row_offset + 1 ...


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step: feed ``token_ids`` at positions
    [start_pos, start_pos + len(token_ids)), with KV blocks ``block_ids``."""

    request_id: str
    token_ids: list[int]  # [num_new] new tokens (a prompt chunk, or the last sampled token)
    start_pos: int  # == the request's num_computed_tokens before this step
    block_ids: list[int]  # block table covering positions [0, start_pos + num_new)
    sampling: SamplingInput | None  # set when this chunk reaches the end: sample a token
    prompt_logprobs: PromptLogprobsInput | None  # None: not asked, or no prompt position here
    # prefill role: after each layer, export the KV of positions [export_from, start_pos + num_new);
    # below start_pos only on the first chunk after a prefix-cache hit (cached here, not there)
    export_from: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]  # in admission order
    num_batched_tokens: int  # sum of len(seq.token_ids)
    preempted_ids: list[str]  # requests preempted while building this step
    num_decodes: int = 0  # seqs feeding one token (their last sampled); the rest are prompt tokens


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs at one position: the chosen (or actual prompt) token first, then the top-N."""

    token_ids: list[int]  # [1 + N]
    logprobs: list[float]  # [1 + N] natural-log probabilities from the raw logits
    ranks: list[int]  # [1 + N] 1-based rank in the vocabulary


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None  # when the request asked for logprobs


@dataclass(frozen=True, slots=True)
class SampleFailed:
    """Sampling (or scoring the prompt of) one sequence failed for a reason of its own; the
    other sequences of the step were sampled as usual."""

    message: str  # what went wrong, for the request's error


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled: dict[str, SampledToken]  # request id -> token sampled this step
    prompt_logprobs: dict[str, list[TokenLogprobs]]  # request id -> one per prompt position covered
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its own sampling failed
