"""Benchmark workloads, generated from a seed so that every server sees identical work.

Prompts are text made of words from a fixed list (so any tokenizer counts roughly one token
per word); the server's usage reports the exact counts."""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = ("river stone market window garden letter engine silver morning harbor candle bridge forest "
          "mirror thunder valley lantern pocket meadow ribbon castle whisper orchard compass ladder "
          "signal canvas marble feather velvet anchor summit blanket cellar harvest").split()


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str | list[int]  # text, or token ids (sent as the OpenAI prompt array)
    max_tokens: int  # output length, enforced with ignore_eos where the server supports it
    group: int  # requests of a group share a prefix (shared-prefix); -1 otherwise
    traffic_class: str | None = None  # --traffic-mix: its class (bench/traffic_mix.py)


def _text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


def shared_prefix(num_prompts: int, seed: int, num_groups: int = 4, system_words: int = 200,
                  question_words: int = 12, output_len: int = 16) -> list[BenchRequest]:
    """``num_groups`` long system prompts, each followed by many short user turns, in a
    shuffled order (so a router that ignores prefixes spreads each group across workers)."""
    rng = random.Random(seed)
    systems = [f"System {g}: " + _text(rng, system_words) for g in range(num_groups)]
    requests = [BenchRequest(f"{systems[i % num_groups]}\nUser: {_text(rng, question_words)}?", output_len,
                             i % num_groups) for i in range(num_prompts)]
    rng.shuffle(requests)
    return requests


@dataclass(frozen=True, slots=True)
class RandomSpec:
    """The ``random`` workload's shape, with `vllm bench serve`'s flag names and defaults."""

    input_len: int = 1024  # --random-input-len: mean prompt length in words (about one token each)
    output_len: int = 128  # --random-output-len
    range_ratio: float = 0.0  # --random-range-ratio: lengths uniform within +-this share of the means
    prefix_len: int = 0  # --random-prefix-len: words every prompt starts with (a shared prefix)

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1 or self.prefix_len < 0 or not 0 <= self.range_ratio < 1:
            raise ValueError("random workload: input and output lengths >= 1, prefix >= 0, range ratio in [0, 1)")


def random_prompts(num_prompts: int, seed: int, spec: RandomSpec = RandomSpec()) -> list[BenchRequest]:
    """Input and output lengths uniform within +-range_ratio of the given means, after a
    prefix of ``prefix_len`` words shared by every prompt."""
    rng = random.Random(seed)

    def around(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - spec.range_ratio)), int(mean * (1 + spec.range_ratio))))

    prefix = _text(rng, spec.prefix_len) + " " if spec.prefix_len else ""
    return [BenchRequest(prefix + _text(rng, around(spec.input_len)), around(spec.output_len), -1)
            for _ in range(num_prompts)]


def long_prompt(num_prompts: int, seed: int) -> list[BenchRequest]:
    """Prefill-heavy: about 1k prompt tokens, 64 out (the workload where a prefill stalls a
    colocated decode batch)."""
    return random_prompts(num_prompts, seed, RandomSpec(input_len=1000, output_len=64, range_ratio=0.05))


def decode_heavy(num_prompts: int, seed: int) -> list[BenchRequest]:
    """The control: short prompts, long outputs (about 32 in, 256 out)."""
    return random_prompts(num_prompts, seed, RandomSpec(input_len=32, output_len=256, range_ratio=0.1))


DATASETS = {"shared-prefix": shared_prefix, "random": random_prompts, "long-prompt": long_prompt,
            "decode-heavy": decode_heavy}


def make_dataset(name: str, num_prompts: int, seed: int, random_spec: RandomSpec | None = None) -> list[BenchRequest]:
    """``random_spec`` shapes the ``random`` workload (default: vLLM's 1024 in, 128 out)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r} (choose from {', '.join(DATASETS)})")
    if name == "random":
        return random_prompts(num_prompts, seed, random_spec or RandomSpec())
    return DATASETS[name](num_prompts, seed)
