"""What every `tandem bench` sub-command shares: progress lines on stderr, the table on stdout,
and the JSON beside it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass


def log(line: str) -> None:
    """A progress line (stderr, so that stdout holds only the table)."""
    print(line, file=sys.stderr, flush=True)


def print_and_save(table: str, out: str | None, as_json: Callable[[], str]) -> int:
    """A bench's table on stdout and, with ``--out``, its JSON (``as_json()``) in that file."""
    print(table)
    if out:
        with open(out, "w") as handle:
            handle.write(as_json())
    return 0


def comma_ints(text: str) -> tuple[int, ...]:
    """``"1,8,32"`` -> ``(1, 8, 32)``."""
    return tuple(int(part) for part in text.split(","))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or None where either side was not measured (a run without vLLM)."""
    return numerator / denominator if numerator and denominator else None


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerOptions:
    """What a bench that times vLLM beside tandem takes on top of its own fields."""

    vllm_python: str | None = None  # the peers venv's python; None: tandem only
    seed: int = 0
