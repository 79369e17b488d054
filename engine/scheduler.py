"""Continuous batching: which requests run in the next forward pass, and with which tokens.

Each step the scheduler walks the running requests in admission order and gives each the
tokens it still lacks KV for (one for a decode, a chunk of the prompt for a prefill) under a
per-step token budget, then admits waiting requests while blocks, sequence slots and budget
allow. When a running request cannot get a block, the newest running request is preempted
(its blocks freed, its tokens to be recomputed later), which keeps older requests moving.

Under the ``priority`` policy (engine/request_queue.py) every "oldest" above reads "highest
class, then oldest": the waiting queue, the order in which prompt chunks share the step, and
the victim of a preemption (the lowest class, then the newest). A waiting request of a higher
class than some running one may also preempt it for a sequence slot or blocks; a request
never preempts one of its own class or a higher one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.config import SchedulerConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.request_queue import SchedulingPolicy, make_queue, priority_key
from engine.scheduler_types import (
    PromptLogprobsInput,
    RunnerOutput,
    SampledToken,
    SamplingInput,
    ScheduledSeq,
    SchedulerOutput,
)
from engine.step_budget import LANE_COST_STALE_S, StepBudget, StepBudgetConfig


@dataclass(frozen=True, slots=True)
class TokenUpdate:
    """What one step did to one request, for the engine core to detokenize and report."""

    request: Request
    new_token_ids: list[int]  # [0 or 1]
    new_logprobs: list  # [0 or 1] TokenLogprobs, when asked
    new_prompt_logprobs: list  # TokenLogprobs for prompt positions covered this step
    finished: bool  # a token-level stop (EOS, stop id, length) fired


@dataclass(slots=True)
class _Step:
    """What one ``schedule`` call has handed out so far."""

    budget: int  # tokens of the step still free (max_num_batched_tokens)
    prompt_room: int  # prompt tokens still free (the step's time target beside its decodes)
    decoding_ids: set[str]  # running requests that decode this step
    prompt_tokens: int = 0  # prompt (or recomputed) tokens handed out so far
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)  # request id -> its tokens this step
    preempted: list[str] = field(default_factory=list)  # for a running request's blocks: admit nothing more
    made_room: list[str] = field(default_factory=list)  # priority policy: lower classes that yielded to waiting ones


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.by_priority = config.policy is SchedulingPolicy.PRIORITY
        self.waiting = make_queue(config.policy)  # WAITING and PREEMPTED, next to admit first
        self.running: list[Request] = []  # RUNNING, admission order
        self.waiting_for_remote_kv: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.remote_kv_deadlines: dict[str, float] = {}  # request id -> monotonic deadline
        self.num_preemptions = 0
        self.step_budget = StepBudget(StepBudgetConfig(config.max_num_batched_tokens, config.max_step_ms))
        # the prefill lane (engine/prefill_lane.py), set by the engine core when it runs one.
        # While the lane is busy, a prompt for it at the head of the queue waits for it rather
        # than stall every decoding stream in the steps, and what queues behind it waits too.
        self.lane = None

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def add_remote_kv_request(self, request: Request, deadline_s: float) -> int | None:
        """Reserve blocks for the whole prompt, reusing this engine's own cached prefix, and
        wait for the rest of its KV to arrive from elsewhere. Returns how many leading prompt
        tokens are already here (the sender sends from there), or None (and changes nothing)
        when the blocks are not available now."""
        if request.request_id in self.requests:
            raise ValueError(f"request id '{request.request_id}' is already in use")
        cached = self.kv.find_cached_prefix(request)
        num_cached = len(cached) * self.kv.block_size
        while not self._allocate(request, request.num_prompt_tokens, cached):
            victim = self._lower_than(request)  # priority policy: a lower class yields its blocks
            if victim is None:
                return None
            self._preempt(victim)
        self.kv.record_lookup(request.num_prompt_tokens, num_cached)
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        self.waiting_for_remote_kv[request.request_id] = request
        self.remote_kv_deadlines[request.request_id] = time.monotonic() + deadline_s
        return num_cached

    def finish_remote_kv(self, request_id: str, first_token: SampledToken) -> TokenUpdate:
        """The prompt's KV has landed in the reserved blocks: join the running batch with the
        first token (which may already end the request: EOS, max_tokens=1, ...)."""
        request = self.waiting_for_remote_kv.pop(request_id)
        self.remote_kv_deadlines.pop(request_id, None)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        finished = self._append_token(request, first_token)
        new_lp = [first_token.logprobs] if first_token.logprobs is not None else []
        return TokenUpdate(request, [first_token.token_id], new_lp, [], finished)

    def expired_remote_kv(self, now: float) -> list[str]:
        """Requests whose KV did not arrive by their deadline (still waiting: the engine
        applies their failure policy)."""
        return [request_id for request_id, deadline in self.remote_kv_deadlines.items() if now >= deadline]

    def requeue_remote_kv(self, request_id: str) -> bool:
        """The `recompute` policy: release the reservation (KV written so far is discarded)
        and queue the request to prefill here, first in line. False if it was not waiting."""
        request = self.waiting_for_remote_kv.pop(request_id, None)
        if request is None:
            return False
        self.remote_kv_deadlines.pop(request_id, None)
        self.kv.free(request_id)
        request.status = RequestStatus.WAITING
        request.num_cached_tokens = 0
        self.waiting.add_back(request)
        return True

    def _allocate(self, request: Request, num_total_tokens: int, cached: list[int] = ()) -> bool:
        """The request's blocks for ``num_total_tokens`` (KVCacheManager.allocate_slots), told how
        far it may grow: its last sampled token needs no KV."""
        may_reach = min(request.num_prompt_tokens + request.max_tokens - 1, self.max_model_len)
        return self.kv.allocate_slots(request.request_id, num_total_tokens, cached, may_reach)

    def take_for_lane(self) -> ScheduledSeq | None:
        """The next waiting prompt, whole, for the prefill lane (engine/prefill_lane.py), if the
        head of the queue is one for it (``_lane_hit``) and a sequence slot and its blocks are
        free. The request then waits like one whose KV comes from elsewhere
        (WAITING_FOR_REMOTE_KV, no deadline) until ``finish_remote_kv``."""
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        request = self.waiting.peek()
        cached = self._lane_hit(request)
        # pace and cost: an idle lane too takes only what it gets through in time (_lane_hit)
        if (cached is None or ((self.lane.busy or self._paced()) and not self._lane_in_time(request))
                or not self._allocate(request, request.num_prompt_tokens, cached)):
            return None
        num_cached = len(cached) * self.kv.block_size
        self.waiting.pop()
        self.kv.record_lookup(request.num_prompt_tokens, num_cached)
        request.num_cached_tokens = request.num_computed_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.waiting_for_remote_kv[request.request_id] = request
        return self._scheduled(request, request.num_prompt_tokens - num_cached)

    def _lane_in_time(self, request: Request) -> bool:
        """The busy lane keeps up with ``request``: it has waited less than
        ``prefill_lane_max_wait_ms`` since it arrived, and by the lane's measured pace
        (``PrefillLane.backlog_ms`` and its ms per token) the lane gets to it within that bound
        and would read everything waiting now within it too. Otherwise waiting for the lane only
        adds to the TTFTs (the steps read each prompt at the bound anyway), and a queue that
        grows faster than the lane's one thread reads it grows on its own: the steps read the
        head now, on the threads the lane leaves them. Before its first measured prompt only
        the bound counts."""
        bound = self.config.prefill_lane_max_wait_ms
        if bound is None:
            return True
        now = time.monotonic()
        backlog = self.lane.backlog_ms(now)
        if (now - request.arrival_time) * 1000.0 + (backlog or 0.0) >= bound:
            return False
        if backlog is None:
            return True
        queued = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return backlog + queued * self.lane.ms_per_token < bound

    def _lane_hit(self, request: Request) -> list[int] | None:
        """Its prefix-cache hit if ``request`` is one for the lane now, else None: it could go
        there (``_lane_fit``), and the policy sends it. Under ``overflow`` it must find prefill
        work under way (``_prefill_pressure``): a lone prompt is read faster in the steps, on
        every thread. Under ``pace`` (and ``cost``) the streams must be slower than the bound
        (``_streams_behind``), and the steps must not be reading a prompt of their own: the two
        would then read a prompt each, each on half the threads, and each prompt's first token
        would come about twice as late as from the steps on every thread one after the other,
        while the steps, reading theirs, would stall the streams as much as ever (issue 20: in
        bursts of long prompts the lane and the steps read two at a time, and those prompts
        were the TTFT tail). For the same reason a queue the lane would not get through within
        ``prefill_lane_max_wait_ms`` goes to the steps even while the lane is idle
        (``take_for_lane``)."""
        policy = self.config.prefill_lane_policy
        if policy == "overflow" and (self.lane is None or not self._prefill_pressure()):
            return None
        if self._paced() and (not self._streams_behind() or self._steps_read_a_prompt()):
            return None
        if policy == "cost" and not self._lane_costs_less():
            return None
        cached = self._lane_fit(request)
        if cached is None or (self._paced() and not self._lane_sooner(request, cached)):
            return None
        return cached

    def _lane_fit(self, request: Request) -> list[int] | None:
        """Its prefix-cache hit if the lane could read ``request``, else None: this engine has a
        lane, streams are decoding (with none, a step of its own on every thread is faster), and
        it is a fresh prompt (not preempted or resumed, no prompt logprobs, nothing to export)
        with at least ``prefill_lane_min_tokens`` left to compute."""
        if (self.lane is None or not self.running or request.status is not RequestStatus.WAITING
                or request.output_token_ids or request.wants_prompt_logprobs or request.kv_export_from is not None):
            return None
        cached = self.kv.find_cached_prefix(request)
        if request.num_prompt_tokens - len(cached) * self.kv.block_size < self.config.prefill_lane_min_tokens:
            return None
        return cached

    def _waits_for_lane(self, request: Request) -> bool:
        """``request`` waits at the head of the queue until the busy lane is done (at most
        ``prefill_lane_max_wait_ms``, and only if the lane gets to it by then: ``_lane_in_time``)
        instead of being read in the steps: it is one for the lane, or, under ``pace``, one the
        lane could read, which the steps would read on the threads the lane leaves them (slowly,
        stalling the streams meanwhile; once the lane is done, the pace decides again)."""
        if self.lane is None or not self.lane.busy:
            return False
        if not self._lane_in_time(request):
            return self._paced() and self._lane_done_first(request)
        if self._paced():
            cached = self._lane_fit(request)
            return cached is not None and self._lane_sooner(request, cached)
        return self._lane_hit(request) is not None

    def _lane_done_first(self, request: Request) -> bool:
        """The busy lane, by its measured pace, is done with what it holds before the steps, on
        every thread, would have read ``request`` (``StepBudget.prompt_ms`` apart from the lane):
        the steps then wait for it and read the prompt on every thread, sooner than on the
        threads the lane leaves them now (where a prompt token costs about twice as much on 2
        cores), and the streams decode beside the lane meanwhile."""
        if self._lane_fit(request) is None:
            return False
        backlog = self.lane.backlog_ms(time.monotonic())
        tokens = request.num_tokens - request.num_computed_tokens
        num_decodes = self._num_decoding()
        steps_ms = self.step_budget.prompt_ms(tokens, num_decodes)
        return backlog is not None and steps_ms is not None and backlog < steps_ms

    def _paced(self) -> bool:
        return self.config.prefill_lane_policy in ("pace", "cost")

    def _num_decoding(self) -> int:
        """Running requests that decode in the next step (their prompts are done)."""
        return sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)

    def _steps_read_a_prompt(self) -> bool:
        """A running request still has prompt tokens to compute in the steps (a chunked prompt)."""
        return any(r.num_tokens - r.num_computed_tokens > 1 for r in self.running)

    def _lane_sooner(self, request: Request, cached: list[int]) -> bool:
        """The lane would give ``request`` its first token within ``prefill_lane_ttft_ratio``
        times what the steps would, by what this engine measured: the lane, after what it holds
        (``PrefillLane.backlog_ms``), at its ms per token; the steps, after the prompt tokens
        that running requests still lack, in steps of their measured cost beside the decodes
        (``StepBudget.prompt_ms``, on the threads the busy lane leaves them). The lane's one
        thread reads a prompt slower than the steps on every thread (1.5-2x), so a prompt it
        takes while the steps have nothing ahead of it forms the TTFT tail; with prompt work
        queued in the steps it is the sooner. True while either side is unmeasured, or with no
        ratio set."""
        ratio = self.config.prefill_lane_ttft_ratio
        if ratio is None or self.lane.ms_per_token is None:
            return True
        tokens = request.num_prompt_tokens - len(cached) * self.kv.block_size
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in self.running
                    if r.num_tokens - r.num_computed_tokens > 1)
        num_decodes = self._num_decoding()
        steps_ms = self.step_budget.prompt_ms(ahead + tokens, num_decodes, beside_lane=self.lane.busy)
        if steps_ms is None:
            return True
        lane_ms = (self.lane.backlog_ms(time.monotonic()) or 0.0) + tokens * self.lane.ms_per_token
        return lane_ms <= ratio * steps_ms

    def _streams_behind(self) -> bool:
        """The decoding streams get their tokens slower than ``prefill_lane_pace_ms`` apart now
        (``StreamPace``): prompts read in the steps would slow them further."""
        pace = self.step_budget.pace.ms(time.monotonic())
        return pace is not None and pace > self.config.prefill_lane_pace_ms

    def _lane_costs_less(self) -> bool:
        """The ``cost`` policy: a prompt read in the lane costs the decoding streams less than one
        read in the steps on every thread, by what this engine has measured (``LaneTradeoff``).
        Until both are measured, the pace alone decides (and sends prompts both ways). What each
        costs follows the load, so a side not measured for ``LANE_COST_STALE_S`` is tried again
        with the next prompt: the lane, or the steps while the lane is idle (the steps then read
        it on every thread)."""
        tradeoff = self.step_budget.tradeoff
        lane_ms, step_ms = tradeoff.lane_ms(self.lane.ms_per_token), tradeoff.step_ms_per_token
        if lane_ms is None or step_ms is None:
            return True
        now = time.monotonic()
        if lane_ms >= step_ms:
            return now - (tradeoff.beside_at or now) > LANE_COST_STALE_S
        return self.lane.busy or now - (tradeoff.prompt_apart_at or now) <= LANE_COST_STALE_S

    def _prefill_pressure(self) -> bool:
        """Prefill work beside the head of the queue: the lane holds a prompt, another request
        waits, or a running request still has prompt tokens to compute (a chunked prompt)."""
        return self.lane.busy or len(self.waiting) > 1 or self._steps_read_a_prompt()

    # -- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # Decodes first, then prompt chunks: a long prompt read in chunks never stalls the
        # running streams. Within each group, admission order (priority policy: class, then
        # arrival, and a waiting request of a higher class is admitted before a running
        # prompt's next chunk). Prompt chunks share what the step's time target leaves beside
        # the decodes (engine/step_budget.py).
        running = sorted(self.running, key=priority_key) if self.by_priority else self.running
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        prefilling = [r for r in running if r.num_tokens - r.num_computed_tokens > 1]
        beside_lane = self.lane is not None and self.lane.busy  # the step will have a thread fewer
        step = _Step(self.config.max_num_batched_tokens, self.step_budget.prompt_tokens(len(decoding), beside_lane),
                     {r.request_id for r in decoding})
        for request in decoding:
            self._schedule_running(request, step)
        for request in prefilling:
            if self.by_priority:
                self._admit_waiting(step, before=request)
            self._schedule_running(request, step)
        self._admit_waiting(step)
        seqs = list(step.scheduled.values())
        total = sum(len(seq.token_ids) for seq in seqs)
        num_decodes = sum(1 for seq in seqs if seq.request_id in step.decoding_ids)
        return SchedulerOutput(seqs=seqs, num_batched_tokens=total, preempted_ids=step.preempted + step.made_room,
                               num_decodes=num_decodes)

    def _schedule_running(self, request: Request, step: _Step) -> None:
        """A running request's next tokens (one to decode, or a prompt chunk), preempting the
        victim (``_victim``) while its blocks do not fit."""
        if step.budget <= 0 or request.status is not RequestStatus.RUNNING:
            return  # the step is full, or it was preempted earlier in this step
        num_left = request.num_tokens - request.num_computed_tokens
        num_new = 1 if num_left == 1 else min(num_left, step.budget, step.prompt_room)
        if num_new <= 0:
            return  # a prompt chunk with no room left this step
        while not self._allocate(request, request.num_computed_tokens + num_new):
            victim = self._victim()
            self._preempt_in_step(victim, step)
            step.preempted.append(victim.request_id)
            if victim is request:
                return
        step.scheduled[request.request_id] = self._scheduled(request, num_new)
        step.budget -= num_new
        step.prompt_room -= num_new if num_left > 1 else 0
        step.prompt_tokens += num_new if num_left > 1 else 0

    def _admit_waiting(self, step: _Step, before: Request | None = None) -> None:
        """Admit waiting requests while a slot, blocks and room allow (none in a step that
        preempted for blocks). ``before``: only those that go before it by priority. Under the
        priority policy a waiting request may take a lower class's slot and blocks."""
        while self.waiting and not step.preempted and min(step.budget, step.prompt_room) > 0:
            request = self.waiting.peek()
            if before is not None and priority_key(request) >= priority_key(before):
                return
            if self._waits_for_lane(request):
                return
            cached = self.kv.find_cached_prefix(request) if request.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            num_left = request.num_tokens - num_cached
            num_new = min(num_left, step.budget, step.prompt_room)
            if num_new < num_left and step.prompt_tokens:
                # A prompt started in what another prompt's chunk leaves of a step would end in the
                # next step, and its chunk there would hold up the first token of whatever that step
                # finishes (issue 20: on long prompts most were read in two steps, the second carrying
                # the next prompt's head). It starts in a step of its own instead.
                return
            if (len(self.running) >= self.config.max_num_seqs
                    or not self._allocate(request, num_cached + num_new, cached)):
                victim = self._lower_than(request)
                if victim is None:
                    return
                self._preempt_in_step(victim, step)
                step.made_room.append(victim.request_id)
                continue  # look again: the slot, the blocks (and what was cached) may have changed
            self.waiting.pop()
            if request.status is RequestStatus.WAITING and request.num_preemptions == 0:
                # (a resumed sequence's hit may reach into its output: the prompt's share is counted)
                request.num_cached_tokens = min(num_cached, request.num_prompt_tokens)
                self.kv.record_lookup(request.num_prompt_tokens, request.num_cached_tokens)
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            step.scheduled[request.request_id] = self._scheduled(request, num_new)
            step.budget -= num_new
            step.prompt_room -= num_new
            step.prompt_tokens += num_new

    def _preempt_in_step(self, victim: Request, step: _Step) -> None:
        """Preempt ``victim``, giving back what this step had scheduled for it."""
        self._preempt(victim)
        undone = step.scheduled.pop(victim.request_id, None)
        if undone is not None:
            step.budget += len(undone.token_ids)
            prompt = 0 if victim.request_id in step.decoding_ids else len(undone.token_ids)
            step.prompt_room += prompt
            step.prompt_tokens -= prompt

    def _victim(self) -> Request:
        """The running request that yields its blocks: the newest (fcfs), or the lowest
        class, then the newest (priority)."""
        if self.by_priority:
            return max(self.running, key=priority_key)
        return self.running[-1]

    def _lower_than(self, request: Request) -> Request | None:
        """Priority policy: the running request that yields to ``request`` (the lowest class,
        then the newest), if its class is lower than ``request``'s; never one of an equal or
        higher class. Always None under fcfs."""
        if not self.by_priority or not self.running:
            return None
        victim = max(self.running, key=priority_key)
        return victim if victim.priority > request.priority else None

    def _preempt(self, request: Request) -> None:
        """A running request yields: out of the batch, its blocks freed, back to waiting."""
        self.running.remove(request)
        self.kv.free(request.request_id)  # its full blocks stay cached: resuming may hit them
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_back(request)

    def _scheduled(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        sampling = None
        if end == request.num_tokens:
            sampling = SamplingInput(
                params=request.sampling_params,
                seed=request.seed,
                position=end,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=request.output_token_ids,
                eos_token_ids=request.eos_token_ids,
            )
        return ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.token_slice(start, end),
            start_pos=start,
            block_ids=list(self.kv.block_table(request.request_id)),
            sampling=sampling,
            prompt_logprobs=self._prompt_logprobs_input(request, start, end),
            export_from=self._export_from(request, start),
        )

    @staticmethod
    def _export_from(request: Request, start: int) -> int | None:
        """Prefill role: the first position whose KV this chunk exports. The first chunk after
        a prefix-cache hit also exports the cached positions the receiver lacks
        ([kv_export_from, start)); later chunks export only what they compute."""
        if request.kv_export_from is None:
            return None
        if start == request.num_cached_tokens:
            return request.kv_export_from
        return max(request.kv_export_from, start)

    @staticmethod
    def _prompt_logprobs_input(request: Request, start: int, end: int) -> PromptLogprobsInput | None:
        if not request.wants_prompt_logprobs:
            return None
        # logits at position p score prompt token p + 1. Positions already scored (the list
        # holds None for token 0, then one entry per scored token) are skipped, so a
        # preempted request that recomputes its prompt does not score it twice.
        first = max(start, len(request.prompt_logprobs) - 1)
        stop = min(end, request.num_prompt_tokens - 1)
        if stop <= first:
            return None
        return PromptLogprobsInput(
            num_top=request.sampling_params.prompt_logprobs,
            row_offset=first - start,
            target_token_ids=request.prompt_token_ids[first + 1 : stop + 1],
        )

    def update_from_output(self, scheduled: SchedulerOutput, output: RunnerOutput) -> list[TokenUpdate]:
        updates = []
        for seq in scheduled.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted after scheduling
            if seq.request_id in output.failed:
                continue  # its own sampling failed: the engine core ends it with an error
            request.num_computed_tokens += len(seq.token_ids)
            self.kv.cache_full_blocks(request)  # before a finish frees the blocks
            new_prompt_lp = output.prompt_logprobs.get(seq.request_id, [])
            sampled = output.sampled.get(seq.request_id)
            if sampled is None:
                if new_prompt_lp:
                    updates.append(TokenUpdate(request, [], [], new_prompt_lp, False))
                continue
            finished = self._append_token(request, sampled)
            new_lp = [sampled.logprobs] if sampled.logprobs is not None else []
            updates.append(TokenUpdate(request, [sampled.token_id], new_lp, new_prompt_lp, finished))
        return updates

    def _append_token(self, request: Request, sampled: SampledToken) -> bool:
        token = sampled.token_id
        request.output_token_ids.append(token)
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        status = None
        if num_output >= params.min_tokens and token in request.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif num_output >= params.min_tokens and token in params.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = token
        elif num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.finish_request(request.request_id, status)
        return status is not None

    # -- finishing ---------------------------------------------------------------------------
    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Retire a request in any state, free its blocks (idempotent; None if unknown)."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_REMOTE_KV:
            del self.waiting_for_remote_kv[request_id]
            self.remote_kv_deadlines.pop(request_id, None)
        else:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request_id)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)
