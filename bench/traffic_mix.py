"""`tandem bench serve --traffic-mix interactive:0.3,batch:0.7`: each request of the workload
is drawn into a traffic class (seeded: the same classes for every server and every run), the
class travels in the request body, and every metric is reported per class beside the whole.

tandem is sent the class by name (``traffic_class``, its server's --traffic-classes); a
server that knows only vLLM's fields is sent ``priority`` alone (``--traffic-field priority``
with ``--traffic-priorities interactive:0,batch:10``), as vLLM under
``--scheduling-policy priority`` expects.
"""

from __future__ import annotations

import dataclasses
import math
import random

from bench.datasets import BenchRequest

FIELDS = ("traffic_class", "priority")  # --traffic-field


def parse_mix(text: str) -> dict[str, float]:
    """``interactive:0.3,batch:0.7`` -> {"interactive": 0.3, "batch": 0.7}; shares sum to 1."""
    mix: dict[str, float] = {}
    for pair in text.split(","):
        name, _, share = pair.strip().partition(":")
        try:
            value = float(share)
        except ValueError:
            raise ValueError(f"--traffic-mix takes CLASS:SHARE pairs, got {pair!r}") from None
        if not name or not 0 < value <= 1 or name in mix:
            raise ValueError(f"--traffic-mix {pair!r}: a new class name and a share in (0, 1]")
        mix[name] = value
    if not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"--traffic-mix shares sum to {sum(mix.values()):g}, not 1")
    return mix


def parse_priorities(text: str | None, mix: dict[str, float]) -> dict[str, int]:
    """``interactive:0,batch:10`` -> a priority for every class of the mix."""
    priorities = {}
    for pair in (text or "").split(","):
        if pair.strip():
            name, _, value = pair.strip().partition(":")
            priorities[name] = int(value)
    missing = sorted(set(mix) - set(priorities))
    if missing:
        raise ValueError(f"--traffic-priorities lacks {', '.join(missing)} (needed with --traffic-field priority)")
    return priorities


def assign(requests: list[BenchRequest], mix: dict[str, float], seed: int) -> list[BenchRequest]:
    """Each request drawn into a class by its share (a seeded draw per position)."""
    rng = random.Random(f"traffic-mix-{seed}")
    names, weights = list(mix), list(mix.values())
    return [dataclasses.replace(r, traffic_class=rng.choices(names, weights)[0]) for r in requests]


def body_fields(field: str, priorities: dict[str, int] | None) -> dict[str, dict]:
    """Class name -> the fields its requests carry."""
    if field == "priority":
        return {name: {"priority": value} for name, value in (priorities or {}).items()}
    return {}  # traffic_class: the name itself (LoadConfig.body)


def keep_only(requests: list[BenchRequest], offsets: list[float], names: str) -> tuple[list[BenchRequest],
                                                                                      list[float]]:
    """``--traffic-only a,b``: the requests of those classes at the offsets the whole mix would
    send them at (a baseline with the same arrivals and none of the other traffic)."""
    kept = set(names.split(","))
    pairs = [(r, o) for r, o in zip(requests, offsets, strict=True) if r.traffic_class in kept]
    return [r for r, _ in pairs], [o for _, o in pairs]
