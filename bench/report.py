"""What every `tandem bench` sub-command shares: progress lines on stderr, the table on stdout,
and the JSON beside it."""

from __future__ import annotations

import sys
from collections.abc import Callable


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
