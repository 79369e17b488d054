"""The prefill lane: a colocated worker computes a long prompt on a thread of its own while
its engine thread keeps decoding.

On a CPU the two halves of serving scale badly together. A step that reads a 1k-token prompt
beside the decoding streams stalls every stream for the whole prompt (or, chunked, for many
longer steps), and neither half gains the full second core: on 2 cores of an AVX-512 EPYC a
decode step of 16 sequences takes 26.6 ms on two threads and 40.5 on one, a 1000-token
prompt 680 ms on one. Run side by side, one thread each, they barely slow each other (the
decode step 42.2 ms, the prompt 674-1110 ms; docs/benchmarks.md "The prefill lane"), where
taking turns stalls the streams. That is what a disaggregated pair does on shared cores,
without the KV copy: the lane writes the prompt's KV straight into the blocks the scheduler
reserved for it.

The engine thread hands over prompts (``Scheduler.take_for_lane``: the head of the queue,
long enough, while streams decode; under the ``overflow`` policy only while other prefill
work is under way, under ``pace`` only while the streams are slower than its bound, under
``cost`` only then and when the lane costs the streams less than the steps would; one
computing and one queued behind it), lends the lane
one of its threads for as long as it holds any (and while it has nothing to step, computes the
lane's prompt itself on all of them, a layer at a time: ``widen``, ``help``, ``narrow``), and
takes the results back between two steps. A prompt of ``SPLIT_MIN_TOKENS`` or more is read in
two halves, the second a layer behind the first: when its last step and such a layer take at
most ``--prefill-lane-help-ms`` together, the engine thread reads a layer of the second half
between two of its steps on its own thread, beside the lane's thread on the first, so the
prompt has both cores while the streams can spare them (DEFAULT_PREFILL_LANE_HELP_MS);
each request then joins the batch with its first token, as one whose KV came from a prefill
worker does. While the lane is full, the next prompt for it waits at the head of the queue
rather than stall the streams in a step (and what arrived after it waits too): the streams'
pace is kept, the prompts queue for one thread, as on a disaggregated pair's prefill worker.
It waits only while the lane keeps up at its measured ms per token (``backlog_ms``): it gets
to that prompt, and would read the whole queue, within the wait bound. A queue that grows
faster than the lane's one thread reads it is read in the steps too, instead of growing on its
own.
The lane touches nothing but its own runner (the shared model and KV tensors, read-only but
for the request's own blocks); the KV manager keeps those blocks pinned so that an abort
meanwhile cannot hand them to another request before the lane is done writing (a prompt
aborted while still queued there is skipped).

Kernels must not hold the GIL while they compute (engine/kernels: ``kNoGil``), or the two
threads would take turns after all.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, replace

import torch

from engine.model_runner import ModelRunner
from engine.platform import name_native_thread
from engine.scheduler_types import RunnerOutput, ScheduledSeq, SchedulerOutput
from engine.step_budget import moving_average

# `tandem serve --prefill-lane-min-tokens` default, for colocated workers (the offline LLM has
# no lane). Measured on 2 cores (docs/benchmarks.md "The prefill lane"): 250-token prompts
# belong in the lane as much as 1k-token ones (random 250/128 at 2.83 req/s: TPOT p90 36 ms
# with the lane, 115 without). Below about 128 tokens a prompt costs a step little more than
# its decodes do; the same cut as --local-prefill-max-tokens.
DEFAULT_PREFILL_LANE_MIN_TOKENS = 128
# `--prefill-lane-max-wait-ms` default: how long a prompt waits for the full lane before the
# steps read it. Lower bounds cost capacity (random 250/128 on the family-25 EPYC: 2.32 req/s
# with 2000 ms, 1.79 with 500 and with 0; docs/benchmarks.md "The prefill lane on the AVX-512
# EPYC of family 25"). Without a bound the lane's one thread is the prefill capacity, and TTFT
# grows without limit past it; with 2000 ms, on the same requests (docs/benchmarks.md "The
# prefill lane"), long-prompt at 1.68 req/s met the SLOs for 50 of 51 (43 unbounded) and random at
# 4.36 req/s for 131 of 131 (74), at a higher ITL p99 (402 against 40 ms at 1.41 req/s).
DEFAULT_PREFILL_LANE_MAX_WAIT_MS = 2000.0
# `--prefill-lane-policy` default: which prompts the lane takes. "first": every prompt long
# enough that reaches the head of the queue while streams decode; the streams keep their pace
# and a prompt's TTFT is mostly the lane's one thread (a 1k-token prompt in 1.7 s on the
# family-25 EPYC). "overflow": the steps read a lone prompt on every thread, and the lane takes
# one only when prefill work is already under way. "pace" (the default): the steps read a
# prompt on every thread while the decoding streams get their tokens at most
# DEFAULT_PREFILL_LANE_PACE_MS apart, and the lane takes it when they are slower. On the
# family-25 EPYC (docs/benchmarks.md "Prompts on every thread while the streams keep pace"),
# at vLLM's capacity rate on random 250/128 its TTFT p90 was 1.53x vLLM's against first's
# 2.1-2.5x, at the same TPOT p90; capacity on long-prompt 0.84 req/s (first 0.771, vLLM
# 0.545), on random 2.53 (first 3.01 in an earlier run, vLLM 2.32-2.53).
# "cost": as "pace", but when the streams are slower than the bound the lane takes a prompt
# only if it costs them less there than in the steps, as the engine measures both while it
# serves (engine/step_budget.py LaneTradeoff). Which is cheaper depends on the CPU: on the
# family-23 EPYC in float32, tandem with the lane off met the SLOs for more requests than with it.
DEFAULT_PREFILL_LANE_POLICY = "pace"
# `--prefill-lane-pace-ms` default: under the "pace" policy, the streams' pace (ms between
# their tokens, engine/step_budget.py StreamPace) above which a prompt goes to the lane. A
# little under the 100 ms TPOT SLO of the capacity searches; 70 sent more prompts to the lane
# for a lower TPOT p90 and a higher TTFT p90 (75 / 689 ms against 83 / 660 at 2.32 req/s).
DEFAULT_PREFILL_LANE_PACE_MS = 80.0
# `--prefill-lane-help-ms` default: while the lane reads a prompt in halves (SPLIT_MIN_TOKENS),
# the engine thread reads a layer of its second half between two steps, on its own thread,
# when its last step and that layer take at most this many ms together: the prompt gets both
# cores while the streams can spare the time, and their tokens stay at most about this far
# apart: the pace policy's bound. On the family-25 EPYC a layer of a 1000-token prompt's half
# takes ~30 ms on one thread and a decode step beside the lane 30-35, so 60 let the engine
# thread read one layer in a whole prompt, 80 about ten (a 1000-token prompt beside three
# streams: 1.55 s alone on the lane, 1.27 s helped, the streams' tokens 35 then 45 ms apart).
DEFAULT_PREFILL_LANE_HELP_MS = 80.0
# `--prefill-lane-ttft-ratio` default (policies pace and cost): the lane takes a prompt only if it
# would give it its first token within this many times what the steps would (Scheduler._lane_sooner);
# None: whenever the policy sends it.
DEFAULT_PREFILL_LANE_TTFT_RATIO: float | None = None
# the weight of the newest layer in the moving average of what a layer of a prompt's second half
# costs the engine thread per token (EngineCore._help_beside)
HELP_COST_SMOOTHING = 0.25
# the weight of the newest prompt in the moving average of the lane's ms per prompt token
LANE_COST_SMOOTHING = 0.25
# A prompt with at least this many tokens to compute is read in two halves (``_Part``): the lane
# thread reads the first; the second, which needs the first's KV of each layer before its own
# attention there, runs a layer behind it, on whichever thread gets to it. While the lane reads
# the first half, the engine thread may read layers of the second between its steps on its own
# thread (``help``: while the streams have slack, engine_core.py), so that the prompt gets both
# cores without a second OpenMP team. Shorter prompts would pay more for reading the weights
# twice than the halves gain.
SPLIT_MIN_TOKENS = 256
# how long the engine thread may hold the lane's prompt (``PrefillLane.widen``) without computing
# a layer of it before the lane thread takes it back: far longer than the engine loop takes
# between two ``help`` calls, so only an engine thread stuck elsewhere loses it
ENGINE_HOLD_S = 1.0


@dataclass(frozen=True, slots=True)
class LaneResult:
    """One prompt the lane computed: its runner output (the first token), or what the forward raised."""

    seq: ScheduledSeq
    output: RunnerOutput | None
    error: BaseException | None
    elapsed_s: float
    started: float  # time.monotonic() when the lane started computing it
    # what a prompt token costs the lane's thread: its own time computing this prompt's layers
    # over the share of the prompt it computed (the engine thread may compute the rest: ``help``),
    # in ms per token of a whole prompt; None if it computed no layer of it
    lane_ms_per_token: float | None = None


class PrefillLane:
    """A thread that runs one whole-prompt forward at a time on ``runner`` (its own, over the
    engine's model and KV cache) with ``threads`` torch threads. ``submit`` and ``take_done``
    belong to the engine thread; ``on_done`` is called on the lane thread after each prompt
    (e.g. to wake an idle engine loop).

    Up to ``depth`` prompts may be submitted and not yet taken back: the one computing and
    those queued behind it, so that the lane starts the next prompt the moment it finishes one
    instead of idling until the engine thread ends its step and takes the result (up to a
    whole step: 40-100 ms of decoding, 500 ms with a prompt chunk in it)."""

    def __init__(self, runner: ModelRunner, threads: int = 1, on_done: Callable[[], None] | None = None,
                 depth: int = 2) -> None:
        self.runner = runner
        self.threads = threads
        self.on_done = on_done
        self.depth = depth
        self._lock = threading.Lock()
        # Who computes the prompt's next layer (``_lane_part``, ``_engine_part``): the lane
        # thread, but for the second half beside it when the engine thread helps and the rest
        # while the engine thread holds the prompt (``widen`` until ``narrow``). Under ``_lock``
        # (``_turns`` waits on it) with what follows, and each part's ``by``.
        self._turns = threading.Condition(self._lock)
        self.engine_holds = False
        self._held_at = 0.0  # time.monotonic() of the engine thread's last ``widen`` or ``help``
        self._job: _Job | None = None  # the prompt computing now
        self._stopping = False
        # request ids submitted and not yet taken back, in order (the engine thread's view)
        self.pending: list[str] = []
        # The lane's measured cost: a moving average of ms per prompt token over the prompts it
        # computed on its own threads alone (the engine thread's view; None before the first).
        self.ms_per_token: float | None = None
        # what the lane has yet to compute, for ``backlog_ms``: under ``_lock``
        self._tokens_left = 0  # prompt tokens submitted and not yet computed (or skipped)
        self._current_tokens = 0  # those of the prompt computing now
        self._current_started: float | None = None  # time.monotonic() when it started
        self._computed_s = 0.0  # time spent computing prompts that are done (``computed_s``)
        self._cancelled: set[str] = set()  # pending ids the lane skips if it has not started them
        self._jobs: queue.SimpleQueue[ScheduledSeq | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[LaneResult] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="prefill-lane", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        return bool(self.pending)

    @property
    def has_room(self) -> bool:
        return len(self.pending) < self.depth

    def submit(self, seq: ScheduledSeq) -> None:
        assert self.has_room, f"the lane holds at most {self.depth} prompts"
        self.pending.append(seq.request_id)
        with self._lock:
            self._tokens_left += len(seq.token_ids)
        self._jobs.put(seq)

    def take_done(self) -> LaneResult | None:
        """The next prompt the lane finished, if it has (never blocks)."""
        try:
            result = self._done.get_nowait()
        except queue.Empty:
            return None
        self.pending.remove(result.seq.request_id)
        self._cancelled.discard(result.seq.request_id)
        if result.output is not None and result.lane_ms_per_token is not None:
            self.ms_per_token = moving_average(self.ms_per_token, result.lane_ms_per_token, LANE_COST_SMOOTHING)
        return result

    def backlog_ms(self, now: float) -> float | None:
        """How long, by its measured ms per token, until the lane has computed what it holds
        now: the rest of the prompt it computes (at least nothing, when it runs over its
        estimate) and those queued behind it. None before its first measured prompt."""
        if self.ms_per_token is None:
            return None
        with self._lock:
            queued = self._tokens_left - self._current_tokens
            current_ms = self._current_tokens * self.ms_per_token
            if self._current_started is not None:
                current_ms = max(0.0, current_ms - (now - self._current_started) * 1000.0)
        return queued * self.ms_per_token + current_ms

    def computed_s(self, now: float) -> float:
        """Seconds the lane has spent computing since it started, the prompt under way
        included up to ``now`` (time.monotonic()): the difference over an engine step is how
        much of that step ran beside a prompt in the lane (``StepShape.lane_share``)."""
        with self._lock:
            current = now - self._current_started if self._current_started is not None else 0.0
            return self._computed_s + max(0.0, current)

    def widen(self) -> None:
        """The engine thread has nothing to step: it takes over the prompt computing now from
        the lane's next layer boundary on, and computes its layers (``help``) until ``narrow``.
        The lane thread goes on with the first half of a prompt read in halves (the engine
        thread reads the second beside it, on its own threads less the lane's), and otherwise
        waits: the engine thread then computes on all its threads. So the lane's thread never
        runs a parallel region of more than ``threads``: a second OpenMP team of two threads in
        the process would make libgomp cut the spin-wait of every team's barriers (more OpenMP
        threads than CPUs) and slow the engine's steps from then on (engine/engine_loop.py)."""
        with self._lock:
            self.engine_holds, self._held_at = True, time.monotonic()

    def wants_help(self) -> bool:
        """The engine thread holds a prompt that has layers left to compute (``help``)."""
        with self._lock:
            return self.engine_holds and self._job is not None and not self._job.finished

    def beside_tokens(self) -> int | None:
        """The lane reads the first half of a prompt read in halves, and the second half's next
        layer is ready for the engine thread (``help`` would compute it without waiting): that
        half's tokens; else None."""
        with self._lock:
            job = self._job
            part = self._engine_part(job) if job is not None and job.beside else None
            return None if part is None else part.tokens

    def help(self, threads: int, timeout_s: float = 2.0) -> bool:
        """On the engine thread: compute the next layer of the prompt under way, then return.
        Beside the lane (a prompt read in halves, the lane on its first): the second half's,
        on ``threads`` less the lane's threads, once the first half is a layer ahead (waiting
        for that at most ``timeout_s``). Otherwise only after ``widen``: the layer after the one
        the lane thread computes (waiting for that), on all ``threads``. False if there was
        nothing to compute or on that timeout. The engine thread's torch threads are ``threads``
        less the lane's afterwards, as while the lane holds any prompt."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                job = self._job
                if job is None or job.finished or not (job.beside or self.engine_holds):
                    return False
                part = self._engine_part(job)
                if part is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._turns.wait(left)
            part.by, self._held_at = "engine", time.monotonic()
            beside = job.beside
        torch.set_num_threads(threads - self.threads if beside else threads)
        try:
            self._compute(job, part)
        finally:
            torch.set_num_threads(threads - self.threads)
        return True

    def narrow(self) -> None:
        """The engine thread steps again: the lane thread computes the prompt's next layers (the
        engine thread may still compute the second half's beside it: ``help``)."""
        with self._lock:
            self.engine_holds = False
            self._turns.notify_all()

    def cancel(self, request_id: str) -> None:
        """Its request ended: skip it if the lane has not started it (its result then has
        neither output nor error). Its blocks stay pinned until the result is taken back."""
        if request_id in self.pending:
            self._cancelled.add(request_id)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._turns.notify_all()
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _main(self) -> None:
        name_native_thread()
        torch.set_num_threads(self.threads)  # this thread's OpenMP team; the engine thread keeps its own
        while True:
            seq = self._jobs.get()
            if seq is None:
                return
            started, clock = time.monotonic(), time.perf_counter()
            if seq.request_id in self._cancelled:
                result = LaneResult(seq, None, None, 0.0, started)
            else:
                with self._lock:
                    self._current_tokens, self._current_started = len(seq.token_ids), started
                num_layers = len(self.runner.kv_cache.layers)
                try:
                    job = _Job([_Part(self.runner.execute_layers(SchedulerOutput(
                        seqs=[part], num_batched_tokens=len(part.token_ids), preempted_ids=[])), len(part.token_ids),
                        num_layers) for part in split_prompt(seq)])
                except Exception as exc:  # the engine thread fails this request alone
                    job = _Job([], error=exc)
                with self._lock:
                    self._job = job
                while (part := self._lane_turn(job)) is not None:
                    self._compute(job, part)
                if not job.finished:  # stop() came first
                    job.error = RuntimeError("the prefill lane stopped before it computed this prompt")
                lane_ms = (job.lane_s * 1000.0 * num_layers / job.lane_token_layers
                           if job.lane_token_layers else None)
                result = LaneResult(seq, job.output, job.error, time.perf_counter() - clock, started, lane_ms)
            with self._lock:
                self._job = None
                self._computed_s += time.monotonic() - started
                self._tokens_left -= len(seq.token_ids)
                self._current_tokens, self._current_started = 0, None
            self._done.put(result)
            if self.on_done is not None:
                self.on_done()

    def _lane_turn(self, job: _Job) -> _Part | None:
        """On the lane thread: the part whose next layer it computes now (its turn taken), once
        one is its to compute; None once the prompt is done (or the lane stops). The first half
        of a prompt read in halves is the lane thread's alone; the rest it computes only while
        the engine thread does not hold the prompt (``widen``). An engine thread that holds the
        prompt but has computed none of it for ``ENGINE_HOLD_S`` loses it back to the lane."""
        with self._lock:
            while not job.finished and not self._stopping:
                part = self._lane_part(job)
                if part is not None:
                    part.by = "lane"
                    return part
                self._turns.wait(ENGINE_HOLD_S)
            return None

    def _lane_part(self, job: _Job) -> _Part | None:
        """Under ``_lock``: the part the lane thread may compute a layer of now, if any."""
        first = job.parts[0]
        if len(job.parts) == 2 and not first.finished:  # the first half is the lane thread's to end
            return first if first.by is None else None
        holding = self.engine_holds and time.monotonic() - self._held_at < ENGINE_HOLD_S
        part = job.parts[-1]
        return None if holding or part.by is not None else part

    def _engine_part(self, job: _Job) -> _Part | None:
        """Under ``_lock``: the part the engine thread may compute a layer of now, if any: the
        second half beside the lane once the first is a layer ahead of it, else (the engine
        holding the prompt) its last unfinished part when no thread computes it."""
        part = job.parts[-1]
        if part.by is not None or part.finished:
            return None
        if job.beside:
            return part if part.done < job.parts[0].done else None
        return part if self.engine_holds else None

    def _compute(self, job: _Job, part: _Part) -> None:
        """Compute ``part``'s next layer on this thread (its turn: ``part.by`` is set), then
        give the turn back."""
        on_lane, started = part.by == "lane", time.perf_counter()
        try:
            next(part.layers)
            part.done += 1
            if on_lane:
                job.lane_s += time.perf_counter() - started
                job.lane_token_layers += part.tokens
        except StopIteration as stop:
            part.output, part.finished = stop.value, True
        except Exception as exc:  # the engine thread fails this request alone
            job.error = exc
        with self._lock:
            part.by = None
            self._turns.notify_all()


def split_prompt(seq: ScheduledSeq) -> list[ScheduledSeq]:
    """The prompt as the lane reads it: whole, or (``SPLIT_MIN_TOKENS`` or more, no prompt
    logprobs, no KV export) its first half, which samples nothing, and its second half, which
    samples the first token as the whole prompt would."""
    num = len(seq.token_ids)
    if num < SPLIT_MIN_TOKENS or seq.prompt_logprobs is not None or seq.export_from is not None:
        return [seq]
    half = num // 2
    return [replace(seq, token_ids=seq.token_ids[:half], sampling=None),
            replace(seq, token_ids=seq.token_ids[half:], start_pos=seq.start_pos + half)]


@dataclass(slots=True)
class _Part:
    """A row range of the lane's prompt: its forward, layer by layer (ModelRunner.execute_layers)."""

    layers: Generator[int, None, RunnerOutput]
    tokens: int  # its prompt tokens
    num_layers: int  # the model's: after as many, one more ``next()`` returns its output
    done: int = 0  # layers computed
    by: str | None = None  # "lane" or "engine" while a thread computes its next layer
    finished: bool = False  # its forward returned
    output: RunnerOutput | None = None


@dataclass(slots=True)
class _Job:
    """The prompt the lane computes now: one part, or two halves (``split_prompt``)."""

    parts: list[_Part]
    error: BaseException | None = None  # it could not start, or a part's forward raised
    lane_s: float = 0.0  # the lane thread's time computing its layers
    lane_token_layers: int = 0  # what it computed of them: a part's tokens per layer

    @property
    def finished(self) -> bool:
        return self.error is not None or all(part.finished for part in self.parts)

    @property
    def beside(self) -> bool:
        """Read in halves, the first with layers left: the lane thread computes them, the engine
        thread may compute the second's layers beside it (once the first half's layers are
        done, what is left of it computes no layer: the second may take every thread)."""
        return len(self.parts) == 2 and self.parts[0].done < self.parts[0].num_layers

    @property
    def output(self) -> RunnerOutput | None:
        """The last part's output: the first token (None on an error)."""
        return None if self.error is not None else self.parts[-1].output
