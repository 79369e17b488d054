"""The offline API: ``LLM(model=...).generate(prompts, params)``, as in vLLM."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_dtype,
)
from engine.engine_core import EngineCore
from engine.llm_engine import LLMEngine
from engine.model_info import ModelInfo, load_model_info
from engine.models.registry import DEFAULT_MODEL
from engine.outputs import RequestOutput
from engine.platform import auto_dtype, resolve_device
from engine.request_queue import SchedulingPolicy
from engine.sampling_params import SamplingParams

Prompt = str | list[int] | dict
ParamsArg = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    """A model loaded in this process, generating for batches of prompts.

    Args mirror vLLM's where they exist: ``model`` (known name, HF directory or .gguf),
    ``dtype`` ("auto" | "float32" | "bfloat16" | "float16"), ``max_model_len``, ``block_size``,
    ``num_kv_blocks`` / ``kv_cache_memory_bytes`` (default: 1 GiB on the CPU; on a GPU, what
    ``gpu_memory_utilization`` of its memory leaves after the weights), ``max_num_seqs``, ``max_num_batched_tokens``
    (the per-step token cap: longer prompts are prefilled in chunks), ``max_step_ms`` (a time target
    for steps that decode and prefill: the prompt chunk is sized from the measured prefill rate so
    that running streams are not stalled; None: the token cap only), ``enable_prefix_caching``,
    ``num_threads`` (torch threads), ``seed``, ``chat_template`` (Jinja source override).
    ``scheduling_policy``: "fcfs" (arrival order) or "priority" (``generate``'s ``priority``,
    lower first; engine/request_queue.py). A prompt dict may carry ``cache_salt``: requests
    only share prefix-cache blocks with requests of the same salt.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 8192,
        max_step_ms: float | None = None,
        scheduling_policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        num_threads: int | None = None,
        seed: int = 0,
        chat_template: str | None = None,
        served_model_name: str | None = None,
        free_order_seed: int | None = None,
        attention_backend: str = "auto",
        device: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        args = EngineArgs(
            model=model, dtype=dtype, max_model_len=max_model_len, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_step_ms=max_step_ms,
            scheduling_policy=scheduling_policy, enable_prefix_caching=enable_prefix_caching,
            num_threads=num_threads, seed=seed,
            chat_template=chat_template, served_model_name=served_model_name,
            attention_backend=attention_backend, device=device, enforce_eager=enforce_eager,
        )
        self.config, self.info = args.create_engine_config()
        self.engine_core = EngineCore(self.config, self.info, free_order_seed)
        self.engine = LLMEngine(self.engine_core)
        self._ids = itertools.count()

    # -- helpers -----------------------------------------------------------------------------
    def get_tokenizer(self):
        return self.info.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.info.generation.default_params()

    def _to_tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt fields {sorted(unknown)} (prompt, prompt_token_ids, cache_salt)")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.info.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise TypeError(f"a prompt is a string, a list of token ids, or a dict; got {type(prompt).__name__}")

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsArg = None,
                 priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt in one continuously batched run; outputs in input order.
        ``priority``: one per prompt, as vLLM's (only under the priority scheduling policy)."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(priorities)} priorities")
        encoded = [self._to_tokens(p) for p in prompts]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in prompts]
        # validate every request before queueing any, so bad input leaves nothing behind
        for index, ((_, token_ids), params, rank) in enumerate(zip(encoded, params_list, priorities)):
            self.engine_core.make_request(f"validate-{index}", token_ids, params, priority=rank)
        request_ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for request_id, (text, token_ids), params, salt, rank in zip(request_ids, encoded, params_list, salts,
                                                                     priorities):
            self.engine.add_request(request_id, text, token_ids, params, cache_salt=salt, priority=rank)
        return self._run(request_ids)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: ParamsArg = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.info.tokenizer
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
            # the template writes its own special tokens (BOS etc.)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params)

    def _run(self, request_ids: list[str]) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        try:
            while len(finished) < len(request_ids):
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
        finally:
            # an interrupt or a failed step must not leave requests holding blocks
            for request_id in request_ids:
                if request_id not in finished:
                    self.engine.abort_request(request_id)
        return [finished[request_id] for request_id in request_ids]


def resolve_max_model_len(arch, requested: int | None) -> int:
    """The context length to serve: ``requested``, or what the model supports."""
    limit = arch.max_position_embeddings
    if arch.sliding_window:
        limit = min(limit, arch.sliding_window)
    if requested is not None and requested > limit:
        raise ValueError(f"max_model_len {requested} exceeds what the model supports ({limit})")
    return requested or limit


@dataclass(frozen=True, slots=True)
class EngineArgs:
    """The engine half of a worker's configuration (the CLI's engine flags); same meanings
    as LLM's arguments. ``create_engine_config`` resolves it into the engine's config;
workers build their engine from that with ``build_core()``, not through ``LLM``."""

    model: str = DEFAULT_MODEL
    dtype: str | torch.dtype = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None  # None: 1 GiB on the CPU; on a GPU, see gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # --gpu-memory-utilization
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_step_ms: float | None = None  # --max-step-ms
    prefill_lane_min_tokens: int | None = None  # --prefill-lane-min-tokens (engine/prefill_lane.py)
    prefill_lane_max_wait_ms: float | None = None  # --prefill-lane-max-wait-ms
    prefill_lane_policy: str = "first"  # --prefill-lane-policy (engine/config.py LANE_POLICIES)
    prefill_lane_pace_ms: float = 80.0  # --prefill-lane-pace-ms (the "pace" policy)
    prefill_lane_help_ms: float | None = None  # --prefill-lane-help-ms
    prefill_lane_ttft_ratio: float | None = None  # --prefill-lane-ttft-ratio
    scheduling_policy: str = "fcfs"  # --scheduling-policy: fcfs | priority
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # --worker-threads: each worker pins its own
    seed: int = 0
    chat_template: str | None = None
    served_model_name: str | None = None
    attention_backend: str = "auto"  # --attention-backend
    device: str = "auto"  # --device
    enforce_eager: bool = False  # --enforce-eager: no CUDA graphs for decode steps

    def create_engine_config(self) -> tuple[EngineConfig, ModelInfo]:
        """Resolve what "auto" and None mean on this machine (dtype, device, context length)
        into the engine's frozen config, with the model's tokenizer and metadata. Pins this
        thread's torch threads when ``num_threads`` is set."""
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        info = load_model_info(self.model, self.chat_template)
        arch = info.arch
        resolved = parse_dtype(self.dtype)
        place = resolve_device(self.device)
        if resolved is None:
            resolved = auto_dtype(place.type, arch.hidden_size, arch.intermediate_size)
            how = "timed on this CPU" if place.type == "cpu" else f"on {place.type}"
            print(f"[tandem] dtype auto -> {str(resolved).removeprefix('torch.')} ({how})", file=sys.stderr, flush=True)
        model_config = ModelConfig(
            model_dir=info.model_dir,
            served_model_name=self.served_model_name or self.model,
            arch=arch,
            dtype=resolved,
            max_model_len=resolve_max_model_len(arch, self.max_model_len),
            chat_template=self.chat_template,
        )
        config = EngineConfig(
            model=model_config,
            cache=CacheConfig(self.block_size, self.num_kv_blocks, self.kv_cache_memory_bytes,
                              self.enable_prefix_caching, self.gpu_memory_utilization),
            scheduler=SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_step_ms,
                                      SchedulingPolicy(self.scheduling_policy), self.prefill_lane_min_tokens,
                                      self.prefill_lane_max_wait_ms, self.prefill_lane_policy,
                                      self.prefill_lane_pace_ms, self.prefill_lane_help_ms,
                                      self.prefill_lane_ttft_ratio),
            num_threads=self.num_threads,
            seed=self.seed,
            attention_backend=self.attention_backend,
            device=str(place),
            enforce_eager=self.enforce_eager,
        )
        return config, info

    def build_core(self, free_order_seed: int | None = None) -> EngineCore:
        """The engine this configuration describes (model loaded, KV cache allocated)."""
        config, info = self.create_engine_config()
        return EngineCore(config, info, free_order_seed)
