"""`/v1/completions` and `/v1/chat/completions`: tokenize, validate, fan out to sequences,
and answer as OpenAI does (one JSON body, or SSE events ending with ``data: [DONE]``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import FinishReason
from engine.sampling_params import MAX_SEED, InvalidParam
from proto import worker_pb2 as pb
from proto.convert import params_to_proto
from router.admission import Ticket
from router.dispatch import Sequence, SequenceChunk
from router.errors import APIError, sse_error
from router.limits import check_sequences
from router.protocol import ChatCompletionRequest, CompletionRequest, RequestKind
from router.request_trace import RequestTrace
from router.state import RouterState


@dataclass(slots=True)
class PreparedRequest:
    """A validated, tokenized request, ready to dispatch: what both front ends (HTTP and the
    public gRPC API) admit, stream and account for, whichever wire it came in on."""

    kind: RequestKind
    response_id: str
    prompt_ids: list[list[int]]  # per prompt
    prompt_texts: list[str]  # per prompt (for echo)
    sequences: list[Sequence]
    num_top_logprobs: int | None  # per generated token, when asked
    started: float = field(default_factory=time.monotonic)  # admission (latency metrics start here; set by admit)
    trace: RequestTrace | None = None  # set by RouterState.admit
    ticket: Ticket | None = None  # its places in admission (set by RouterState.admit)
    echo: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


@dataclass(slots=True)
class Choice:
    index: int
    prompt_index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0  # how often the decode worker preempted it (its last chunk says)
    first_token_at: float | None = None  # time.monotonic() of its first token (metrics, traces)
    last_token_at: float | None = None  # ... and of its latest

    def add(self, chunk: pb.GenerateChunk) -> None:
        self.text += chunk.text_delta
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs
        self.prompt_logprobs += chunk.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        self.num_preemptions += chunk.num_preemptions
        if chunk.finish_reason:
            self.finish_reason = FinishReason(chunk.finish_reason)
            kind = chunk.WhichOneof("stop_reason")
            self.stop_reason = getattr(chunk, kind) if kind else None


# -- preparing ----------------------------------------------------------------------------------
# ``check_*`` run on the event loop before admission (no tokenizing: cheap, bounded by the
# limits); ``prepare_*`` run in the tokenizer pool once admitted.
def check_completion(state: RouterState, body: CompletionRequest) -> int:
    """Everything that can be checked before tokenizing; returns the request's sequences."""
    state.check_model(body.model)
    body.check_limits(state.config.limits, state.vocab_size)
    return check_sequences(state.config.limits, len(body.prompts()), body.n, state.config.max_queue)


def check_chat(state: RouterState, body: ChatCompletionRequest) -> int:
    state.check_model(body.model)
    body.check_limits(state.config.limits, state.vocab_size)
    return check_sequences(state.config.limits, 1, body.n, state.config.max_queue)


def prepare_completion(state: RouterState, body: CompletionRequest, request_id: str,
                       priority: int = 0) -> PreparedRequest:
    tokenizer = state.tokenizer
    texts, ids = [], []
    for prompt in body.prompts():
        if isinstance(prompt, str):
            texts.append(prompt)
            ids.append(tokenizer.encode(prompt))
        else:
            texts.append(tokenizer.decode(prompt, skip_special_tokens=False))
            ids.append(list(prompt))
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    prepared = PreparedRequest(RequestKind.COMPLETION, f"cmpl-{request_id}", ids, texts, [], body.logprobs,
                               echo=body.echo)
    _finish_prepare(state, body, prepared, request_id, body.max_tokens, body.logprobs, prompt_logprobs, priority)
    return prepared


def chat_token_ids(state: RouterState, conversation: list[dict], add_generation_prompt: bool,
                   param: str = "messages") -> tuple[str, list[int]]:
    """The conversation rendered with the chat template, and its token ids (tokenizer pool)."""
    try:
        text = state.tokenizer.apply_chat_template(conversation, add_generation_prompt)
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None
    return text, state.tokenizer.encode(text, add_special_tokens=False)  # the template wrote its own


def prepare_chat(state: RouterState, body: ChatCompletionRequest, request_id: str,
                 priority: int = 0) -> PreparedRequest:
    text, ids = chat_token_ids(state, body.conversation(), body.add_generation_prompt)
    num_top = (body.top_logprobs or 0) if body.logprobs else None
    prepared = PreparedRequest(RequestKind.CHAT, f"chatcmpl-{request_id}", [ids], [text], [], num_top)
    max_tokens = body.max_completion_tokens or body.max_tokens
    _finish_prepare(state, body, prepared, request_id, max_tokens, num_top, None, priority)
    return prepared


async def admit(state: RouterState, body: CompletionRequest | ChatCompletionRequest,
                request_id: str) -> PreparedRequest:
    """The one way in for both front ends: the cheap checks here, on the event loop; then a
    place in admission; then tokenizing in the tokenizer pool."""
    if isinstance(body, ChatCompletionRequest):
        num_sequences, prepare = check_chat(state, body), prepare_chat
    else:
        num_sequences, prepare = check_completion(state, body), prepare_completion
    choice = state.resolve_class(body.traffic_class, body.priority)
    return await state.admit(lambda: prepare(state, body, request_id, choice.priority), request_id, num_sequences,
                             choice)


def _finish_prepare(state: RouterState, body, prepared: PreparedRequest, request_id: str, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None, priority: int) -> None:
    limit = state.config.max_model_len
    param = "messages" if prepared.kind is RequestKind.CHAT else "prompt"
    for ids in prepared.prompt_ids:
        if not ids:
            raise APIError(400, "the prompt is empty", param)
        wanted = len(ids) + (max_tokens or 1)
        if wanted > limit or len(ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{wanted} tokens ({len(ids)} in the messages, {max_tokens or 1} in the completion). "
                                "Please reduce the length of the messages or completion.", param)
    try:
        params = body.sampling_params(state.generation, max_tokens, logprobs, prompt_logprobs)
    except InvalidParam as exc:
        raise APIError(400, str(exc), exc.param) from None
    if body.stream_options is not None:
        prepared.include_usage = body.stream_options.include_usage
        prepared.continuous_usage = body.stream_options.continuous_usage_stats
    index = 0
    for prompt_index, ids in enumerate(prepared.prompt_ids):
        for sample in range(body.n):
            # as LLM.generate fans out n: each sample of a seeded request gets seed + its index
            seed = params.seed + sample if params.seed is not None and params.n > 1 else params.seed
            if seed is not None and seed > MAX_SEED:
                raise APIError(400, f"seed + n - 1 must stay below 2**64 (seed {params.seed}, n {body.n})", "seed")
            # the dispatcher makes each attempt's worker id unique (this id plus a random suffix)
            message = pb.GenerateRequest(request_id=f"{request_id}-{index}", prompt_token_ids=ids,
                                         params=params_to_proto(params.with_overrides(n=1, seed=seed)),
                                         cache_salt=body.cache_salt or "", priority=priority)
            prepared.sequences.append(Sequence(index, prompt_index, message))
            index += 1


# -- answering ----------------------------------------------------------------------------------
async def respond(state: RouterState, prepared: PreparedRequest, stream: bool):
    if stream:
        return StreamingResponse(_sse(state, prepared), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    choices = {s.index: Choice(s.index, s.prompt_index) for s in prepared.sequences}
    try:
        async for item in state.dispatcher.merged(prepared.sequences):
            if not isinstance(item, SequenceChunk):
                raise item.error
            choices[item.sequence.index].add(item.chunk)
            state.record_chunk(prepared, choices[item.sequence.index], item.chunk)
    finally:
        state.finish_request(prepared, choices.values())
    body = {
        "id": prepared.response_id, "object": _object_name(prepared, streamed=False),
        "created": int(time.time()), "model": state.config.served_model_name,
        "choices": [_full_choice(prepared, c) for c in sorted(choices.values(), key=lambda c: c.index)],
        "usage": usage_of(prepared, choices.values()),
    }
    return JSONResponse(body)


def _full_choice(prepared: PreparedRequest, choice: Choice) -> dict:
    if prepared.kind is RequestKind.CHAT:
        return {"index": choice.index, "message": {"role": "assistant", "content": choice.text},
                "logprobs": _chat_logprobs(choice.logprobs, prepared.num_top_logprobs),
                "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
    text, positions = choice.text, list(choice.logprobs)
    if prepared.echo:
        text = prepared.prompt_texts[choice.prompt_index] + text
        positions = list(choice.prompt_logprobs) + positions
    return {"index": choice.index, "text": text,
            "logprobs": _completion_logprobs(positions, prepared.num_top_logprobs),
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


async def _sse(state: RouterState, prepared: PreparedRequest) -> AsyncIterator[str]:
    choices = {s.index: Choice(s.index, s.prompt_index) for s in prepared.sequences}
    created = int(time.time())
    echoed: set[int] = set()
    try:
        async for item in state.dispatcher.merged(prepared.sequences):
            if not isinstance(item, SequenceChunk):
                yield sse_error(item.error.status, item.error.message)
                break
            choice = choices[item.sequence.index]
            first = not choice.token_ids and not choice.finish_reason
            choice.add(item.chunk)
            state.record_chunk(prepared, choice, item.chunk)
            event = _stream_choice(prepared, choice, item.chunk, first, echoed)
            payload = {"id": prepared.response_id, "created": created, "model": state.config.served_model_name,
                       "object": _object_name(prepared, streamed=True),
                       "choices": [event]}
            if prepared.continuous_usage:
                payload["usage"] = usage_of(prepared, choices.values())
            yield f"data: {json.dumps(payload)}\n\n"
        else:
            if prepared.include_usage:
                payload = {"id": prepared.response_id, "created": created, "model": state.config.served_model_name,
                           "object": _object_name(prepared, streamed=True),
                           "choices": [], "usage": usage_of(prepared, choices.values())}
                yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        state.finish_request(prepared, choices.values())


def _stream_choice(prepared: PreparedRequest, choice: Choice, chunk: pb.GenerateChunk, first: bool,
                   echoed: set[int]) -> dict:
    finish = chunk.finish_reason or None
    stop = choice.stop_reason if finish else None
    if prepared.kind is RequestKind.CHAT:
        delta = {"content": chunk.text_delta}
        if first:
            delta["role"] = "assistant"
        return {"index": choice.index, "delta": delta, "finish_reason": finish, "stop_reason": stop,
                "logprobs": _chat_logprobs(list(chunk.logprobs), prepared.num_top_logprobs)}
    text, positions = chunk.text_delta, list(chunk.logprobs)
    if prepared.echo and choice.index not in echoed:
        echoed.add(choice.index)
        text = prepared.prompt_texts[choice.prompt_index] + text
        positions = list(chunk.prompt_logprobs) + positions
    return {"index": choice.index, "text": text, "finish_reason": finish, "stop_reason": stop,
            "logprobs": _completion_logprobs(positions, prepared.num_top_logprobs)}


def _object_name(prepared: PreparedRequest, streamed: bool) -> str:
    """OpenAI's ``object`` of a response (streamed: of each of its chunks)."""
    if prepared.kind is RequestKind.COMPLETION:
        return "text_completion"
    return "chat.completion.chunk" if streamed else "chat.completion"


def usage_of(prepared: PreparedRequest, choices) -> dict:
    choices = list(choices)
    prompt_tokens = sum(len(ids) for ids in prepared.prompt_ids)
    cached = {}
    for choice in choices:
        cached[choice.prompt_index] = max(cached.get(choice.prompt_index, 0), choice.num_cached_tokens)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


def _top(position: pb.PositionLogprobs, num_top: int) -> list[pb.TokenLogprob]:
    return sorted(position.entries, key=lambda e: e.rank)[:num_top]


def _completion_logprobs(positions: list[pb.PositionLogprobs], num_top: int | None) -> dict | None:
    if num_top is None:
        return None
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for position in positions:
        if not position.entries:  # the first prompt token: nothing scores it
            tokens.append("")
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            chosen = position.entries[0]
            tokens.append(chosen.decoded_token)
            token_logprobs.append(chosen.logprob)
            top_logprobs.append({e.decoded_token: e.logprob for e in _top(position, num_top)} if num_top else None)
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_logprobs(positions: list[pb.PositionLogprobs], num_top: int | None) -> dict | None:
    if num_top is None:
        return None
    content = []
    for position in positions:
        chosen = position.entries[0]
        content.append({
            "token": chosen.decoded_token, "logprob": chosen.logprob, "bytes": list(chosen.decoded_token.encode()),
            "top_logprobs": [{"token": e.decoded_token, "logprob": e.logprob, "bytes": list(e.decoded_token.encode())}
                             for e in _top(position, num_top)],
        })
    return {"content": content}
