"""The OpenAI request bodies the gateway accepts, with vLLM's extras, and their translation
into engine SamplingParams. Validation errors become OpenAI-shaped 400s (router/errors.py);
checks across fields raise APIError, which pydantic passes through, so that each 400 names
its field.

Fields OpenAI defines but tandem does not implement are declared so that a request using
them gets a 400 naming the field, never a silent ignore; fields nobody defines are refused
as unknown."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.sampling_params import MAX_SEED, GenerationDefaults, SamplingParams
from router.errors import APIError
from router.limits import RequestLimits, check_input_chars, check_stop, check_token_ids


class RequestKind(StrEnum):
    COMPLETION = "completion"  # /v1/completions; gRPC text or token_ids
    CHAT = "chat"  # /v1/chat/completions; gRPC chat


MAX_LOGPROBS = 20
UINT32_MAX = (1 << 32) - 1  # token counts travel as uint32 to the workers
INT32_MAX = (1 << 31) - 1


# OpenAI's and vLLM's fields that tandem does not implement: declared, so that a request using
# one gets a 400 naming it (never a silent ignore)
UNSUPPORTED_FIELDS = ("logit_bias", "best_of", "suffix", "tools", "tool_choice", "functions", "function_call",
                      "response_format", "parallel_tool_calls", "audio", "modalities", "prediction", "service_tier",
                      "store", "metadata", "reasoning_effort", "web_search_options", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar", "structured_outputs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    """Sampling fields shared by completions and chat (OpenAI's, then vLLM's extras). Numbers
    are bounded here by what the engine and the worker protocol accept; limits that are
    server flags (router/limits.py) are checked by ``check_limits``."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    user: str | None = None  # accepted (OpenAI sends it for abuse tracking); not used
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's priority (lower runs first; --scheduling-policy priority) and cache_salt (prefix-cache
    # blocks are shared only between requests of the same salt); tandem's traffic_class
    # (router/traffic.py). Unset priority: the class's.
    priority: int | None = Field(None, ge=-(1 << 31), le=INT32_MAX)
    traffic_class: str | None = Field(None, min_length=1, max_length=64)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # declared so that they can be refused by name
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    service_tier: Any = None
    store: Any = None
    metadata: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name in UNSUPPORTED_FIELDS:
            if getattr(self, name) is not None and not (name == "best_of" and self.best_of in (1, self.n)):
                raise APIError(400, f"'{name}' is not supported by this server", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", "stream_options")
        return self

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        """The checks shared by both endpoints that need the server's limits (APIError)."""
        check_stop(limits, self.stop)
        check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")

    def sampling_params(self, defaults: GenerationDefaults, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """vLLM's rule: a field the request leaves unset takes the model's generation_config
        default, then SamplingParams' own. Raises ValueError on inconsistent values."""
        model = defaults.default_params()
        return SamplingParams(
            n=self.n,
            temperature=model.temperature if self.temperature is None else self.temperature,
            top_p=model.top_p if self.top_p is None else self.top_p,
            top_k=model.top_k if self.top_k is None else self.top_k,
            min_p=model.min_p if self.min_p is None else self.min_p,
            repetition_penalty=model.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            stop=self.stop or (),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=UINT32_MAX)  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return list(prompt)

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        super().check_limits(limits, vocab_size)
        prompts = self.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "the prompt is empty", "prompt")
        check_input_chars(limits, [p for p in prompts if isinstance(p, str)], "prompt")
        for ids in prompts:
            if not isinstance(ids, str):
                check_token_ids(ids, vocab_size, "prompt")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _check_parts(self):
        self.text()  # a part that is not text is refused here, by field
        return self

    def text(self) -> str:
        """Text content; a list of parts may hold text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template: Any = None  # vLLM lets a request override the template; tandem does not

    @model_validator(mode="after")
    def _check_chat(self):
        if self.chat_template is not None:
            raise APIError(400, "'chat_template' per request is not supported; start the server with --chat-template",
                           "chat_template")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return self

    def check_limits(self, limits: RequestLimits, vocab_size: int) -> None:
        super().check_limits(limits, vocab_size)
        check_input_chars(limits, [m.text() for m in self.messages], "messages")

    def conversation(self) -> list[dict]:
        return [{"role": m.role if m.role != "developer" else "system", "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", "prompt")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    tokens: list[int]
