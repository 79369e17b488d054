"""CPU noise for `tandem bench served --noise`: a process that wakes ``rate`` times a second and
computes for ``work_us`` each time, standing in for what runs beside an engine on shared cores
(a router, an HTTP client, Ray's timers): ``rate * work_us`` is its share of one core.

An engine's decode step is a few hundred OpenMP parallel regions; a thread that such a wake-up
preempts mid-region holds its team at the next barrier, so a little CPU elsewhere can cost the
step more than its share. Timing each engine alone, then under the same noise, measures that
sensitivity for both engines in one run: the part of a served step's cost that comes from
sharing the cores rather than from the serving path's own work.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass

_LOOP = """
import sys, time
period, work = 1.0 / float(sys.argv[1]), float(sys.argv[2]) / 1e6
while True:
    time.sleep(period)
    end = time.perf_counter() + work
    while time.perf_counter() < end:
        pass
"""


@dataclass(frozen=True, slots=True)
class Noise:
    rate: float  # wake-ups per second
    work_us: float  # microseconds of computing per wake-up

    def __post_init__(self) -> None:
        if not (self.rate > 0 and self.work_us > 0 and self.rate * self.work_us < 1e6):
            raise ValueError(f"noise: a rate > 0 and work > 0 under one core (rate x work < 1 s), got "
                             f"{self.rate:g}/s x {self.work_us:g} us")

    @property
    def share(self) -> float:
        """Its share of one core."""
        return self.rate * self.work_us / 1e6

    def __str__(self) -> str:
        return f"{self.rate:g} wake-ups/s x {self.work_us:g} us ({self.share:.1%} of a core)"

    @classmethod
    def parse(cls, text: str) -> Noise:
        """``RATE:US``, e.g. ``900:150``."""
        rate, _, work = text.partition(":")
        try:
            return cls(float(rate), float(work))
        except ValueError:
            raise ValueError(f"--noise takes RATE:US (wake-ups per second : microseconds each), got {text!r}") from None

    @contextlib.contextmanager
    def running(self):
        """The noise process, for the length of the block."""
        process = subprocess.Popen([sys.executable, "-c", _LOOP, str(self.rate), str(self.work_us)])
        try:
            yield process
        finally:
            process.kill()
            process.wait(10)


class NoisySide:
    """Another bench side measured while ``noise`` runs: the same engine, paused and resumed
    with it, and closed by it."""

    def __init__(self, inner, noise: Noise) -> None:
        self.inner, self.noise = inner, noise
        self.name = f"{inner.name} + noise"
        self.command = f"{inner.command}, beside a process of {noise}"

    def measure(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        with self.noise.running():
            return self.inner.measure(prompts, max_tokens)

    def pause(self) -> None:
        self.inner.pause()

    def resume(self) -> None:
        self.inner.resume()

    def close(self) -> None:  # the inner side is in the list too, and closes itself
        pass
