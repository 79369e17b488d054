"""Per-request sampling parameters, with vLLM's field names, defaults and meanings."""

from __future__ import annotations

from dataclasses import dataclass, replace

MAX_SEED = (1 << 64) - 1  # seeds are 64-bit unsigned (the worker protocol's uint64)


class InvalidParam(ValueError):
    """A request field the engine cannot accept. ``param`` names the field (the OpenAI error
    body's ``param``), so every edge can tell the client which one is at fault."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's tokens and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 and ``top_p == 1`` disable those
    filters. ``logprobs=N`` returns, per generated token, the N most likely tokens plus the
    chosen one (0 = the chosen one only); ``prompt_logprobs`` does the same for prompt tokens.
    ``seed`` makes sampling a pure function of (seed, token position).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        # accept a single string / list for stop, a list for stop_token_ids (vLLM does)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("min_p", self.min_p),
                            ("repetition_penalty", self.repetition_penalty),
                            ("presence_penalty", self.presence_penalty),
                            ("frequency_penalty", self.frequency_penalty)):
            if value != value or value in (float("inf"), float("-inf")):
                raise InvalidParam(name, f"{name} must be a finite number, got {value}")

        def fail(message: str) -> None:  # every message starts with the field it is about
            raise InvalidParam(message.split(" ", 1)[0], message)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}")
        if self.logprobs is not None and self.logprobs < 0:
            fail(f"logprobs must be non-negative, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            fail(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}")
        if self.repetition_penalty <= 0.0:
            fail(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if any(not s for s in self.stop):
            fail("stop strings must not be empty")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            fail(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def effective_top_k(self) -> int:
        """0 when disabled."""
        return max(self.top_k, 0)

    def with_overrides(self, **changes) -> "SamplingParams":
        return replace(self, **changes)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a checkpoint's generation_config.json says. The stop ids always apply; the
    sampling fields become the defaults when the caller passes no SamplingParams (as vLLM)."""

    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation unless ignore_eos
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # from max_new_tokens

    def default_params(self) -> SamplingParams:
        names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return SamplingParams(**given)
