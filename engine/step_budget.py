"""How many prompt tokens a step may compute: the token cap, and a time target when prefill
shares the step with decoding sequences.

A decode step of a running batch takes roughly a fixed time (its weights are read once);
every prompt token added to that step adds roughly a fixed cost on top. So a step that
decodes ``num_decodes`` sequences and prefills ``k`` prompt tokens takes about

    decode_ms + k * ms_per_prompt_token

and the largest ``k`` that keeps the step under ``max_step_ms`` is what the scheduler may
give prompt chunks. Both terms are measured on this engine, step by step (exponential moving
averages), so the chunk follows the machine, the model, the dtype and the thread count:

    steps that only decode       -> decode_ms
    steps that compute prompts   -> ms_per_prompt_token = (elapsed - decode part) / k

With nothing decoding, no stream waits on the step, and prompts get the whole token cap
(``max_num_batched_tokens``): one long pass is the fastest way through a prompt. Until the
first step with prompt tokens has been timed, a step that decodes gives prompts
``min_chunk_tokens``.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

# `tandem serve --max-step-ms` default (the offline LLM has none): chosen by measured capacity
# (issue 20; README "Chunking bounded by time"). Smaller chunks cost more per prompt token, and
# under a steady load that cost lengthens every decoding stream's steps more than the shorter
# stalls save: 150 ms kept long-prompt capacity at 1.19 req/s on 2 cores, where whole prompts
# held 2.0 req/s within both SLOs. 500 ms still bounds a stall to about what vLLM's 2048-token
# CPU budget allows there.
DEFAULT_MAX_STEP_MS = 500.0

# histogram buckets of the chosen chunk sizes (tandem:prefill_chunk_tokens), in tokens
CHUNK_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class StepBudgetConfig:
    max_num_batched_tokens: int  # the hard cap on tokens per step (vLLM's name)
    max_step_ms: float | None  # target for a step that decodes and prefills; None: the cap only
    min_chunk_tokens: int = 16  # prompts always progress by at least this much per step
    smoothing: float = 0.25  # weight of the newest step in the moving averages

    def __post_init__(self) -> None:
        if self.max_step_ms is not None and not self.max_step_ms > 0:
            raise ValueError(f"max_step_ms must be > 0, got {self.max_step_ms}")
        if self.min_chunk_tokens < 1 or not 0 < self.smoothing <= 1:
            raise ValueError("min_chunk_tokens must be >= 1 and smoothing in (0, 1]")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one executed step did, for the budget to learn from."""

    num_decodes: int  # sequences that fed one token (their last sampled one)
    num_prompt_tokens: int  # prompt (or recomputed) tokens fed by the other sequences
    elapsed_s: float  # the forward pass and sampling, wall clock
    ended_at: float | None = None  # time.monotonic() when it ended (the streams' pace: StreamPace)
    lane_share: float = 0.0  # the share of its time during which the prefill lane computed a prompt (LaneTradeoff)


@dataclass(slots=True)
class StepTotals:
    """Every executed step's own time (forward and sampling) since the engine started, apart for
    steps that only decode (the shape `tandem bench engine` times offline) and steps that read
    prompt tokens too; workers report them in Stats."""

    num_decode_steps: int = 0
    decode_steps_ms: float = 0.0
    decode_steps_seqs: int = 0  # the sequences those steps decoded, summed (their mean batch)
    num_prompt_steps: int = 0
    prompt_steps_ms: float = 0.0


class StepBudget:
    """Owned by the scheduler, which asks it once per step; the engine core tells it what each
    executed step did (``observe``). Not thread-safe: the engine thread alone uses it (Stats
    readers only copy the histogram)."""

    def __init__(self, config: StepBudgetConfig) -> None:
        self.config = config
        self.decode_ms: float | None = None  # EWMA of steps that only decode
        self.ms_per_prompt_token: float | None = None  # EWMA of the marginal cost of a prompt token
        self.chunk_counts = [0] * (len(CHUNK_TOKEN_BUCKETS) + 1)  # per bucket (last: above every bound)
        self.chunk_sum = 0  # prompt tokens over every step that computed some
        self.pace = StreamPace()
        self.totals = StepTotals()
        self.tradeoff = LaneTradeoff(config.smoothing)

    def prompt_tokens(self, num_decodes: int, beside_lane: bool = False) -> int:
        """Prompt tokens the next step may compute, given that ``num_decodes`` sequences decode
        in it (the decodes come out of the token cap separately); ``beside_lane``: the step will
        run beside the prefill lane's prompt, on the threads the lane leaves it (``costs``)."""
        cap = self.config.max_num_batched_tokens
        target = self.config.max_step_ms
        if target is None or num_decodes == 0:
            return cap
        decode_ms, per_token = self.costs(beside_lane)
        if per_token is None:
            return min(cap, self.config.min_chunk_tokens)
        room_ms = target - (decode_ms or 0.0)
        return max(self.config.min_chunk_tokens, min(cap, int(room_ms / per_token)))

    def costs(self, beside_lane: bool = False) -> tuple[float | None, float | None]:
        """(a decode-only step's ms, a prompt token's marginal ms in a step), for a step apart from
        the prefill lane (measured on steps apart from it, else on every step) or beside it (the
        decode part apart times the lane's slowdown; a prompt token at what steps beside the lane
        measured, else its cost apart times the slowdown). Apart from the lane a step has every
        thread, beside it one fewer: on 2 cores a prompt token there costs about twice as much
        (issue 20: with the two blended, steps apart from the lane split most ~1k-token prompts
        in two)."""
        tradeoff = self.tradeoff
        decode_ms = tradeoff.decode_ms_apart or self.decode_ms
        per_token = tradeoff.step_ms_per_token or self.ms_per_prompt_token
        if not beside_lane:
            return decode_ms, per_token
        slowdown = tradeoff.slowdown or 1.0
        if tradeoff.step_ms_per_token_beside is not None:
            per_token = tradeoff.step_ms_per_token_beside
        elif per_token is not None:
            per_token *= max(1.0, slowdown)
        return (None if decode_ms is None else decode_ms * slowdown), per_token

    def prompt_ms(self, num_tokens: int, num_decodes: int, beside_lane: bool = False) -> float | None:
        """How long the steps would take to read ``num_tokens`` prompt tokens beside
        ``num_decodes`` decoding sequences, by what this engine measured (``costs``): steps of at
        most ``prompt_tokens(num_decodes)`` prompt tokens, each its decode part plus its tokens'
        marginal cost; ``beside_lane``: the steps run beside the lane's prompt. None before a
        step that read prompt tokens has been timed."""
        decode_ms, per_token = self.costs(beside_lane)
        if per_token is None:
            return None
        if num_tokens <= 0:
            return 0.0
        steps = -(-num_tokens // self.prompt_tokens(num_decodes, beside_lane))
        decode_part = (decode_ms or 0.0) if num_decodes else 0.0
        return steps * decode_part + num_tokens * per_token

    def observe(self, shape: StepShape) -> None:
        if shape.num_decodes and shape.ended_at is not None:
            self.pace.observe(shape.ended_at)
        self.tradeoff.observe(shape)
        elapsed_ms, totals = shape.elapsed_s * 1000, self.totals
        if shape.num_prompt_tokens == 0:
            totals.num_decode_steps += 1
            totals.decode_steps_ms += elapsed_ms
            totals.decode_steps_seqs += shape.num_decodes
            if shape.num_decodes:
                self.decode_ms = self._average(self.decode_ms, elapsed_ms)
            return
        totals.num_prompt_steps += 1
        totals.prompt_steps_ms += elapsed_ms
        self._count(shape.num_prompt_tokens)
        marginal = marginal_ms_per_prompt_token(shape, self.decode_ms)
        self.ms_per_prompt_token = self._average(self.ms_per_prompt_token, marginal)

    def _average(self, current: float | None, sample: float) -> float:
        return moving_average(current, sample, self.config.smoothing)

    def _count(self, num_tokens: int) -> None:
        index = next((i for i, bound in enumerate(CHUNK_TOKEN_BUCKETS) if num_tokens <= bound),
                     len(CHUNK_TOKEN_BUCKETS))
        self.chunk_counts[index] += 1
        self.chunk_sum += num_tokens


def moving_average(current: float | None, sample: float, weight: float) -> float:
    """An exponential moving average with ``weight`` for the newest ``sample`` (the first sample
    when there is none yet)."""
    return sample if current is None else current + weight * (sample - current)


def marginal_ms_per_prompt_token(shape: StepShape, decode_ms: float | None) -> float:
    """A step's ms per prompt token beyond its decode part (``decode_ms``, the decode-only step's
    mean; nothing when the step decoded nothing)."""
    elapsed_ms = shape.elapsed_s * 1000
    decode_part = (decode_ms or 0.0) if shape.num_decodes else 0.0
    # a step can beat the estimate of its decode part (noise): the prompt tokens still cost something
    return max(elapsed_ms - decode_part, elapsed_ms * 0.1) / shape.num_prompt_tokens


def lane_stream_ms(lane_ms_per_token: float, slowdown: float) -> float:
    """What a prompt token read in the prefill lane costs the decoding streams (LaneTradeoff): its
    time on the lane's thread times the share of their steps the streams lose meanwhile (at least
    0: a step beside the lane can beat one apart from it, by noise or a smaller batch)."""
    return lane_ms_per_token * max(0.0, 1.0 - 1.0 / slowdown)


# A step ran beside the prefill lane when the lane computed for at least BESIDE_LANE of its time,
# apart from it when for at most APART_FROM_LANE; steps in between teach LaneTradeoff nothing.
BESIDE_LANE = 0.9
APART_FROM_LANE = 0.05
# The ``cost`` lane policy tries a side again (the lane, or the steps) when what it costs the
# streams was last measured this long ago: a few seconds of a request's life, so that the
# choice follows the load; at 4 req/s one prompt in 120 at most goes the dearer way.
LANE_COST_STALE_S = 30.0


class LaneTradeoff:
    """What a prompt costs the decoding streams per prompt token, read in the steps or in the
    prefill lane (engine/prefill_lane.py), both measured on this engine as it serves (moving
    averages), for the ``cost`` lane policy.

    - In the steps, on every thread, each prompt token holds up every stream for its marginal
      cost in a step: ``step_ms_per_token``, from steps that read prompt tokens apart from the
      lane (a step's time less the decode-only step's), averaged over tokens rather than steps
      (``TokenAverage``: a short chunk, the tail of a prompt read in two, costs more a token
      than a whole prompt and says less about the next one). ``step_ms_per_token_beside`` is
      the same for steps beside the lane (StepBudget.costs sizes their chunks with it).
    - In the lane, the prompt takes ``lane_ms_per_token`` (the lane's own measure) on the lane's
      thread, and the steps beside it run on the threads it leaves them, ``slowdown`` times as
      long as apart from it (decode-only steps beside the lane, each against the mean decode-only
      step apart from it at the time). Over the prompt's time the streams lose the share
      ``1 - 1 / slowdown`` of their steps: ``lane_ms_per_token * (1 - 1 / slowdown)``.

    On 2 cores the second depends on how well a decode step scales from one thread to two (how
    memory-bound it is) and on what the two threads take from each other's caches and memory
    bandwidth; the first on how well a prompt does. Neither is known before serving."""

    def __init__(self, smoothing: float = 0.25) -> None:
        self.smoothing = smoothing
        self.decode_ms_apart: float | None = None  # decode-only steps apart from the lane
        self.slowdown: float | None = None  # a decode-only step beside the lane / apart from it
        self._apart = TokenAverage(smoothing)  # a prompt token's marginal ms in a step apart from the lane
        self._beside = TokenAverage(smoothing)  # ... in a step beside it
        # time.monotonic() of the newest sample of ``slowdown`` and of ``step_ms_per_token`` (how fresh each side is)
        self.beside_at: float | None = None
        self.prompt_apart_at: float | None = None

    def observe(self, shape: StepShape) -> None:
        elapsed_ms, ended_at = shape.elapsed_s * 1000, shape.ended_at or time.monotonic()
        apart = shape.lane_share <= APART_FROM_LANE
        if shape.num_prompt_tokens == 0:
            if not shape.num_decodes:
                return
            if apart:
                self.decode_ms_apart = self._average(self.decode_ms_apart, elapsed_ms)
            elif shape.lane_share >= BESIDE_LANE and self.decode_ms_apart:
                self.slowdown = self._average(self.slowdown, elapsed_ms / self.decode_ms_apart)
                self.beside_at = ended_at
            return
        if apart:
            marginal = marginal_ms_per_prompt_token(shape, self.decode_ms_apart)
            self._apart.add(marginal * shape.num_prompt_tokens, shape.num_prompt_tokens)
            self.prompt_apart_at = ended_at
        elif shape.lane_share >= BESIDE_LANE and self.decode_ms_apart and self.slowdown:
            marginal = marginal_ms_per_prompt_token(shape, self.decode_ms_apart * self.slowdown)
            self._beside.add(marginal * shape.num_prompt_tokens, shape.num_prompt_tokens)

    @property
    def step_ms_per_token(self) -> float | None:
        return self._apart.value

    @property
    def step_ms_per_token_beside(self) -> float | None:
        return self._beside.value

    def lane_ms(self, lane_ms_per_token: float | None) -> float | None:
        """What a prompt token read in the lane costs the streams (ms), or None before the lane
        has computed a prompt and run beside a decode-only step apart from one. At least 0: a
        step beside the lane can beat one apart from it (noise, a smaller batch)."""
        if lane_ms_per_token is None or self.slowdown is None:
            return None
        return lane_stream_ms(lane_ms_per_token, self.slowdown)

    def _average(self, current: float | None, sample: float) -> float:
        return moving_average(current, sample, self.smoothing)


class TokenAverage:
    """An exponential moving average of ms per token weighted by tokens: the steps' ms and their
    tokens are averaged apart, each with ``smoothing`` for the newest step, and the estimate is
    the one over the other, so that a step of 100 tokens counts a tenth as much as one of 1000
    (steps of equal size: the plain moving average of their ms per token)."""

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self._ms = 0.0
        self._tokens = 0.0

    def add(self, ms: float, tokens: int) -> None:
        if tokens <= 0:
            return
        new = self.smoothing if self._tokens else 1.0
        self._ms += new * (ms - self._ms)
        self._tokens += new * (tokens - self._tokens)

    @property
    def value(self) -> float | None:
        return self._ms / self._tokens if self._tokens else None


# how far back StreamPace looks: a few seconds of steps, less than one request's life (128
# tokens at 40-100 ms), so that it follows the load as it changes
PACE_WINDOW_S = 2.0


class StreamPace:
    """How often the decoding streams get a token now: the mean time between the ends of the
    steps that decoded, over the last ``window_s`` of wall time. Everything the streams wait
    for counts: prompt tokens read in their steps, a step slowed by the prefill lane's thread,
    the host's time between steps. A step under way that has already taken longer than that
    mean counts as one that ended now (a long prompt being read stalls the streams already)."""

    def __init__(self, window_s: float = PACE_WINDOW_S) -> None:
        self.window_s = window_s
        self._ends: deque[float] = deque()

    def observe(self, ended_at: float) -> None:
        self._ends.append(ended_at)
        self._forget(ended_at)

    def ms(self, now: float) -> float | None:
        """The mean ms between decoding steps, or None with fewer than two in the window. It
        changes nothing, so another thread (a Stats call) may read it while the engine steps."""
        ends = [end for end in list(self._ends) if end >= now - self.window_s]
        if len(ends) < 2:
            return None
        span, intervals = ends[-1] - ends[0], len(ends) - 1
        if now - ends[-1] > span / intervals:
            span, intervals = now - ends[0], intervals + 1
        return 1000.0 * span / intervals

    def _forget(self, now: float) -> None:
        while self._ends and self._ends[0] < now - self.window_s:
            self._ends.popleft()
