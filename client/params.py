"""The SDK's sampling parameters: the engine's fields and defaults (vLLM's names), without
importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from proto import worker_pb2


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``None`` leaves a field to the server (the model's generation_config, then vLLM's
    default). ``max_tokens=None``: 16 for text prompts, the rest of the context for chat."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None  # top-N per generated token (0: the chosen token only)
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    def to_proto(self) -> worker_pb2.SamplingParams:
        message = worker_pb2.SamplingParams(stop=list(self.stop), stop_token_ids=list(self.stop_token_ids),
                                            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                                            include_stop_str_in_output=self.include_stop_str_in_output)
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "logprobs",
                     "repetition_penalty", "presence_penalty", "frequency_penalty", "skip_special_tokens"):
            value = getattr(self, name)
            if value is not None:
                setattr(message, name, value)
        return message
