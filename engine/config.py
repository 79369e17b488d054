"""Engine configuration: one frozen dataclass per component, composed into EngineConfig.

Each component receives only its own part. Values are validated in ``__post_init__``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.request_queue import SchedulingPolicy

# which prompts the prefill lane takes (engine/prefill_lane.py, `--prefill-lane-policy`)
LANE_POLICIES = ("first", "overflow", "pace", "cost")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# prompt positions scored per logits matrix for prompt logprobs: bounds that matrix to
# [PROMPT_LOGPROBS_ROWS, vocab] however long the chunk (the GPU's activation headroom counts it)
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """llama3-style frequency scaling (HF ``rope_type: llama3``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """The architecture of a Llama-family checkpoint, read from its config.json."""

    model_type: str  # llama | mistral | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None  # Mistral; caps max_model_len (no windowed attention here)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type '{self.model_type}' is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @classmethod
    def from_hf_dir(cls, model_dir: Path) -> "ModelArchConfig":
        raw = json.loads((model_dir / "config.json").read_text())
        model_type = raw.get("model_type", "")
        # transformers 5 writes rope settings under rope_parameters, older ones under rope_scaling
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None
        if rope_type == "llama3":
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"{model_dir}: rope_type '{rope_type}' is not supported (default, llama3)")
        heads = int(raw["num_attention_heads"])
        window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
        return cls(
            model_type=model_type,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            sliding_window=int(window) if window else None,
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which checkpoint to run and how."""

    model_dir: Path  # resolved HF-style directory
    served_model_name: str
    arch: ModelArchConfig
    dtype: torch.dtype
    max_model_len: int  # prompt + generated tokens per sequence
    chat_template: str | None = None  # operator override (Jinja source)

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV cache."""

    block_size: int = 16  # tokens per block
    num_kv_blocks: int | None = None  # exact pool size; None = derive from the memory budget
    # budget used when num_kv_blocks is None; None: 1 GiB on the CPU, on a GPU what
    # gpu_memory_utilization leaves after the weights (kv_cache.gpu_kv_budget)
    kv_cache_memory_bytes: int | None = None
    enable_prefix_caching: bool = True  # reuse full blocks whose token prefix is already cached
    gpu_memory_utilization: float = 0.9  # share of a GPU's memory this engine may bring it to

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be >= 1, got {self.kv_cache_memory_bytes}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64  # sequences running at once
    max_num_batched_tokens: int = 8192  # tokens in one forward pass: the hard cap on a prefill chunk
    # a step that decodes and prefills stays under this (engine/step_budget.py); None: the cap only
    max_step_ms: float | None = None
    # fcfs: arrival order, the newest running request yields blocks; priority: by (priority,
    # arrival), the lowest class yields (engine/request_queue.py); vLLM's --scheduling-policy
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    # a prompt with at least this many tokens to compute, arriving while streams decode, is
    # read on a thread of its own (engine/prefill_lane.py; CPU, two threads or more); None: off
    prefill_lane_min_tokens: int | None = None
    # a prompt for the busy lane waits for it at most this long, then is read in the steps (at
    # once where the lane would not get through it and the queue in time); None: as long as it takes
    prefill_lane_max_wait_ms: float | None = None
    # which prompts the lane takes (LANE_POLICIES): "first", every one long enough;
    # "overflow", only those that find prefill work already under way; "pace", only while
    # the decoding streams are slower than prefill_lane_pace_ms
    prefill_lane_policy: str = "first"
    # the "pace" policy: the lane takes a prompt only while the decoding streams get their
    # tokens slower than this many ms apart (engine/step_budget.py StreamPace); faster, the
    # steps read it on every thread
    prefill_lane_pace_ms: float = 80.0
    # while the lane reads a prompt in halves, the engine thread reads a layer of its second half
    # between two steps when the last step and that layer take at most this many ms together
    # (engine/prefill_lane.py); None: only while it has nothing to step
    prefill_lane_help_ms: float | None = None
    # "pace" and "cost": the lane takes a prompt only if, by the measured rates, it would give the
    # prompt its first token within this many times what the steps would (their queue of prompt
    # tokens included); None: whenever the policy sends it
    prefill_lane_ttft_ratio: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.policy, SchedulingPolicy):
            object.__setattr__(self, "policy", SchedulingPolicy(self.policy))
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0 (or None), got {self.max_step_ms}")
        if self.prefill_lane_min_tokens is not None and self.prefill_lane_min_tokens < 1:
            raise ValueError(f"prefill_lane_min_tokens must be >= 1 (or None), got {self.prefill_lane_min_tokens}")
        if self.prefill_lane_max_wait_ms is not None and not self.prefill_lane_max_wait_ms >= 0:
            raise ValueError(f"prefill_lane_max_wait_ms must be >= 0 (or None), got {self.prefill_lane_max_wait_ms}")
        if not 0 < self.prefill_lane_pace_ms < float("inf"):
            raise ValueError(f"prefill_lane_pace_ms must be > 0, got {self.prefill_lane_pace_ms}")
        if self.prefill_lane_help_ms is not None and not 0 < self.prefill_lane_help_ms < float("inf"):
            raise ValueError(f"prefill_lane_help_ms must be > 0 (or None), got {self.prefill_lane_help_ms}")
        if self.prefill_lane_ttft_ratio is not None and not 0 < self.prefill_lane_ttft_ratio < float("inf"):
            raise ValueError(f"prefill_lane_ttft_ratio must be > 0 (or None), got {self.prefill_lane_ttft_ratio}")
        if self.prefill_lane_policy not in LANE_POLICIES:
            raise ValueError(f"prefill_lane_policy must be one of {', '.join(LANE_POLICIES)}, "
                             f"got {self.prefill_lane_policy!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    seed: int = 0  # seeds the random per-request seeds of unseeded requests
    attention_backend: str = "auto"  # auto (Triton on CUDA, torch elsewhere) | torch | triton
    device: str = "auto"  # where the model, the KV cache and each step's tensors live: cpu | cuda | auto
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (engine/decode_graphs.py), as vLLM's flag


def parse_dtype(name: str | torch.dtype) -> torch.dtype | None:
    """``float32``/``bfloat16``/``float16`` (and torch dtypes) -> dtype; ``auto`` -> None."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ValueError(f"dtype {name} is not supported (float32, bfloat16, float16)")
        return name
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    key = aliases.get(name, name)
    if key == "auto":
        return None
    if key not in _DTYPES:
        raise ValueError(f"dtype '{name}' is not supported (auto, float32, bfloat16, float16)")
    return _DTYPES[key]
