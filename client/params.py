"""The SDK's sampling parameters: the engine's fields and defaults (vLLM's names), without
importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from proto import worker_pb2
from proto.sampling import sampling_to_proto


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
        return sampling_to_proto(self)
