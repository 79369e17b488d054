"""The router's prediction of a request's time to first token, for SLO-aware admission
(router/admission.py), whatever the routing policy and mode:

    predicted = queue wait at the router + prefill + KV transfer

- queue wait: the sequences that would be dispatched before it (queued here with a priority
  at least as high, plus its own) beyond the room on the workers, divided by the rate at
  which sequences finish (measured over the last ``window_s``; unknown until a few have
  finished, when the wait counts as 0);
- prefill: on the worker that would prefill it soonest (the prefill pool in disaggregated
  mode, else the decode workers), the prompt tokens this router has queued there plus the
  request's uncached tokens, divided by that worker's measured prefill rate
  (router/workers.py: prompt tokens per second of its busy time; router/policy.py
  unmeasured_prefill_rate until measured);
- transfer: disaggregated mode only, the KV transfer's unhidden tail as recent requests saw
  it (a moving average of their ``kv_transfer`` stage).

It is an estimate for refusing work early, not a promise: docs/observability.md shows how
to compare it with the measured TTFT.
"""

from __future__ import annotations

import time
from collections import deque

from proto.rpc import Role
from router.policy import unmeasured_prefill_rate
from router.workers import WorkerPool

MIN_FINISHED = 4  # finished sequences in the window before the queue wait is estimated


class TTFTPredictor:
    def __init__(self, pool: WorkerPool, window_s: float = 30.0) -> None:
        self.pool = pool
        self.window_s = window_s
        self._finished: deque[float] = deque()  # time.monotonic() of each sequence's end, within the window
        self.transfer_s = 0.0  # moving average of the kv_transfer stage (remote prefills)

    def sequence_finished(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._finished.append(now)
        self._trim(now)

    def transfer_observed(self, seconds: float) -> None:
        self.transfer_s = seconds if not self.transfer_s else 0.8 * self.transfer_s + 0.2 * seconds

    def finish_rate(self, now: float | None = None) -> float | None:
        """Sequences finished per second over the window; None while too few have."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        if len(self._finished) < MIN_FINISHED:
            return None
        span = max(now - self._finished[0], 1e-3)
        return len(self._finished) / span

    def _trim(self, now: float) -> None:
        while self._finished and self._finished[0] < now - self.window_s:
            self._finished.popleft()

    def predict(self, num_prompt_tokens: int, num_cached_tokens: int, sequences_ahead: int, room: int) -> float:
        """Seconds to the first token of a request of ``num_prompt_tokens`` (``num_cached_tokens``
        of them cached on the best worker) with ``sequences_ahead`` sequences to be dispatched
        before it (its own included) and ``room`` sequences that may be dispatched now."""
        wait = 0.0
        excess = sequences_ahead - room
        rate = self.finish_rate()
        if excess > 0 and rate:
            wait = excess / rate
        prefill_workers = [w for w in self.pool.routable(Role.PREFILL) if w.healthy]
        remote = bool(prefill_workers)
        workers = prefill_workers or [w for w in self.pool.routable(Role.DECODE) if w.healthy]
        uncached = max(0, num_prompt_tokens - num_cached_tokens)
        unmeasured = unmeasured_prefill_rate(workers)  # PREFILL_RATE_DEFAULT while none is measured
        prefill = min(((w.prompt_tokens_in_flight + uncached) / (w.prefill_rate or unmeasured) for w in workers),
                      default=uncached / unmeasured)
        return wait + prefill + (self.transfer_s if remote else 0.0)
