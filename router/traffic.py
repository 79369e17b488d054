"""Traffic classes: named kinds of traffic with a priority, latency targets and whether the
router may shed them (``--traffic-classes FILE``), and the scheduling policy that orders them
(``--scheduling-policy``, vLLM's flag).

The file (YAML or JSON) maps a class name to its settings; every setting is optional::

    interactive: {priority: 0, ttft_ms: 2000, tpot_ms: 150}
    batch:       {priority: 10, ttft_ms: 60000, sheddable: true}

A request names its class with ``traffic_class`` (absent: ``default``, which the file may
define and otherwise is priority 0, no targets, never shed) and may give ``priority``
itself, which overrides its class's. As in vLLM, lower priorities run first, and under
``fcfs`` every priority must be 0.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from engine.request_queue import SchedulingPolicy
from router.errors import APIError

DEFAULT_CLASS = "default"
CLASS_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # also a metrics label value
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1  # priority travels as int32 to the workers
_SETTINGS = ("priority", "ttft_ms", "tpot_ms", "sheddable")


@dataclass(frozen=True, slots=True)
class TrafficClass:
    name: str
    priority: int = 0  # lower runs first (--scheduling-policy priority)
    ttft_ms: float | None = None  # time-to-first-token target: admission sheds past it (if sheddable)
    tpot_ms: float | None = None  # time-per-output-token target (reported per class; bench SLOs)
    sheddable: bool = False  # the router may answer 429 when its predicted TTFT misses ttft_ms

    def __post_init__(self) -> None:
        if not CLASS_NAME.fullmatch(self.name):
            raise ValueError(f"traffic class name {self.name!r}: 1-64 characters of A-Z a-z 0-9 . _ -")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or not INT32_MIN <= self.priority <= INT32_MAX:
            raise ValueError(f"traffic class {self.name}: priority must be a 32-bit integer, got {self.priority!r}")
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < math.inf):
                raise ValueError(f"traffic class {self.name}: {name} must be a positive number, got {value!r}")
        if not isinstance(self.sheddable, bool):
            raise ValueError(f"traffic class {self.name}: sheddable must be true or false, got {self.sheddable!r}")
        if self.sheddable and self.ttft_ms is None:
            raise ValueError(f"traffic class {self.name}: a sheddable class needs ttft_ms (what it is shed against)")


@dataclass(frozen=True, slots=True)
class ClassChoice:
    """What a request's class fields resolve to."""

    traffic_class: TrafficClass
    priority: int  # the request's own, else its class's


@dataclass(frozen=True, slots=True)
class TrafficClasses:
    policy: SchedulingPolicy = SchedulingPolicy.FCFS
    classes: dict[str, TrafficClass] = field(default_factory=lambda: {DEFAULT_CLASS: TrafficClass(DEFAULT_CLASS)})

    def __post_init__(self) -> None:
        if DEFAULT_CLASS not in self.classes:
            raise ValueError(f"the traffic classes lack {DEFAULT_CLASS!r}")
        if self.policy is SchedulingPolicy.FCFS:
            ranked = sorted(c.name for c in self.classes.values() if c.priority != 0)
            if ranked:
                raise ValueError(f"traffic classes {', '.join(ranked)} have a priority other than 0, which needs "
                                 "--scheduling-policy priority")

    def resolve(self, name: str | None, priority: int | None) -> ClassChoice:
        """The request's class and priority, or a 400 naming the field."""
        chosen = self.classes.get(name or DEFAULT_CLASS)
        if chosen is None:
            raise APIError(400, f"unknown traffic_class {name!r}; this server has {', '.join(sorted(self.classes))}",
                           "traffic_class")
        if priority is None:
            return ClassChoice(chosen, chosen.priority)
        if not INT32_MIN <= priority <= INT32_MAX:
            raise APIError(400, f"priority must be a 32-bit integer, got {priority}", "priority")
        if priority != 0 and self.policy is SchedulingPolicy.FCFS:
            raise APIError(400, f"priority {priority} needs --scheduling-policy priority; this server schedules "
                                "fcfs, where every request has priority 0", "priority")
        return ClassChoice(chosen, priority)

    @property
    def names(self) -> list[str]:
        return sorted(self.classes)


def load_traffic_classes(path: str | Path | None, policy: SchedulingPolicy | str) -> TrafficClasses:
    """``--traffic-classes FILE`` (None: only ``default``) under ``--scheduling-policy``;
    ValueError says what is wrong with the file."""
    policy = SchedulingPolicy(policy)
    if path is None:
        return TrafficClasses(policy)
    text = Path(path).read_text()
    try:
        raw = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"--traffic-classes {path}: not valid {'JSON' if str(path).endswith('.json') else 'YAML'}: "
                         f"{exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"--traffic-classes {path}: expected a mapping of class name -> settings")
    classes = {}
    for name, settings in raw.items():
        settings = settings or {}
        if not isinstance(settings, dict):
            raise ValueError(f"--traffic-classes {path}: class {name!r}: expected a mapping of settings")
        unknown = set(settings) - set(_SETTINGS)
        if unknown:
            raise ValueError(f"--traffic-classes {path}: class {name!r}: unknown settings {sorted(unknown)} "
                             f"(known: {', '.join(_SETTINGS)})")
        classes[str(name)] = TrafficClass(str(name), **settings)
    classes.setdefault(DEFAULT_CLASS, TrafficClass(DEFAULT_CLASS))
    return TrafficClasses(policy, classes)
