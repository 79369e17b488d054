"""tandem's model-execution core: model, paged KV cache, scheduler, sampler, offline API."""

from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
