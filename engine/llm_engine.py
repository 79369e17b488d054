"""LLMEngine: requests with ``n`` sequences on top of EngineCore, assembled into RequestOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.engine_core import EngineCore, EngineCoreOutput
from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _ParentState:
    output: RequestOutput
    child_ids: list[str] = field(default_factory=list)  # index i -> core request id


class LLMEngine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}  # core id -> (request id, index)

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> None:
        """Validate all n sequences first (raises ValueError, allocates nothing), then queue."""
        if request_id in self._parents:
            raise ValueError(f"request id '{request_id}' is already in use")
        children = []
        for index in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}#{index}"
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = params.with_overrides(seed=params.seed + index)
            children.append(self.core.make_request(child_id, prompt_token_ids, child_params, cache_salt,
                                                     priority=priority))
        with_logprobs = params.logprobs is not None
        output = RequestOutput(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
            outputs=[
                CompletionOutput(i, "", [], 0.0 if with_logprobs else None, [] if with_logprobs else None)
                for i in range(params.n)
            ],
            finished=False,
        )
        state = _ParentState(output)
        for index, child in enumerate(children):
            self.core.add_request(child)
            state.child_ids.append(child.request_id)
            self._child_to_parent[child.request_id] = (request_id, index)
        self._parents[request_id] = state

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort every sequence of the request (idempotent; None if unknown)."""
        state = self._parents.get(request_id)
        if state is None:
            return None
        for child_id in state.child_ids:
            core_output = self.core.abort_request(child_id)
            if core_output is not None:
                self._apply(core_output)
        # sequences the core no longer knew (failed in a step) end as aborted too
        for child_id, completion in zip(state.child_ids, state.output.outputs):
            if completion.finish_reason is None:
                completion.finish_reason = FinishReason.ABORT
                self._child_to_parent.pop(child_id, None)
        state.output.finished = True
        self._parents.pop(request_id, None)
        return state.output

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    def step(self) -> list[RequestOutput]:
        """One forward pass; returns the RequestOutputs that changed (finished ones included)."""
        touched: dict[str, RequestOutput] = {}
        for core_output in self.core.step():
            output = self._apply(core_output)
            touched[output.request_id] = output
        return list(touched.values())

    def _apply(self, core_output: EngineCoreOutput) -> RequestOutput:
        parent_id, index = self._child_to_parent[core_output.request_id]
        output = self._parents[parent_id].output
        completion = output.outputs[index]
        completion.token_ids.extend(core_output.new_token_ids)
        completion.text += core_output.text_delta
        if completion.logprobs is not None:
            completion.logprobs.extend(core_output.new_logprobs)
            for token_id, position in zip(core_output.new_token_ids, core_output.new_logprobs):
                completion.cumulative_logprob += position[token_id].logprob
        if index == 0 and output.prompt_logprobs is not None:
            output.prompt_logprobs.extend(core_output.new_prompt_logprobs)
        output.num_cached_tokens = max(output.num_cached_tokens, core_output.num_cached_tokens)
        if core_output.finish_reason is not None:
            completion.finish_reason = core_output.finish_reason
            completion.stop_reason = core_output.stop_reason
            del self._child_to_parent[core_output.request_id]
            if all(c.finish_reason is not None for c in output.outputs):
                output.finished = True
                del self._parents[parent_id]
        return output
