"""The decode-step timing loop shared by tandem's side (bench/context_bench.py) and vLLM's
(vllm_decode.py, which runs in the peers venv and imports this file by its directory): both
engines are timed by the same lines. Standard library only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sized


def median_decode_step_ms(step: Callable[[], Sized], has_unfinished: Callable[[], bool], num_sequences: int,
                          token_ids_of: Callable[[Sized], Iterable[str]]) -> float:
    """Run ``step`` until nothing is unfinished; the median milliseconds of the steps taken once
    every one of ``num_sequences`` has its first token (``token_ids_of(outputs)``: the request
    ids that received a token in that step)."""
    started: set[str] = set()
    steps = []
    while has_unfinished():
        began = time.perf_counter()
        outputs = step()
        elapsed = time.perf_counter() - began
        decoding = len(started) == num_sequences  # every sequence had its first token before this step
        started.update(token_ids_of(outputs))
        if decoding and outputs:
            steps.append(elapsed)
    return statistics.median(steps) * 1000
