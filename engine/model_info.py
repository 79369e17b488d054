"""Everything about a checkpoint except its weights: architecture, tokenizer, defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from engine.config import ModelArchConfig
from engine.models.fetch import resolve_model
from engine.sampling_params import GenerationDefaults
from engine.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str  # what the user asked for (--model)
    model_dir: Path  # resolved HF-style directory
    arch: ModelArchConfig
    tokenizer: Tokenizer
    generation: GenerationDefaults

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.generation.eos_token_ids


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def read_generation_defaults(model_dir: Path, tokenizer: Tokenizer, config_eos) -> GenerationDefaults:
    path = model_dir / "generation_config.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    eos = _as_ids(raw.get("eos_token_id")) or _as_ids(config_eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return GenerationDefaults(
        eos_token_ids=tuple(eos),
        temperature=raw.get("temperature"),
        top_p=raw.get("top_p"),
        top_k=raw.get("top_k"),
        min_p=raw.get("min_p"),
        repetition_penalty=raw.get("repetition_penalty"),
        max_tokens=raw.get("max_new_tokens"),
    )


def load_model_info(model: str, chat_template: str | None = None) -> ModelInfo:
    model_dir = resolve_model(model)
    arch = ModelArchConfig.from_hf_dir(model_dir)
    tokenizer = Tokenizer(model_dir, chat_template)
    raw_config = json.loads((model_dir / "config.json").read_text())
    generation = read_generation_defaults(model_dir, tokenizer, raw_config.get("eos_token_id"))
    return ModelInfo(model, model_dir, arch, tokenizer, generation)
