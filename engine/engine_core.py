"""EngineCore: scheduler + block pool + model runner, stepped one forward pass at a time.

It takes requests as token ids, and reports per step, per request, the new tokens, their
text (incremental, stop strings enforced here) and logprobs. It knows nothing about Ray,
gRPC or Redis; workers drive it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine import envs
from engine.attention import make_attention_backend
from engine.config import EngineConfig
from engine.decode_graphs import DecodeGraphs, wants_decode_graphs
from engine.detokenizer import IncrementalDetokenizer
from engine.kernels import prefill_attention
from engine.kv_cache.block_hash import namespace_digest
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.kv_cache import KVCache, activation_headroom, gpu_kv_budget, num_blocks_for
from engine.kv_cache.manager import KV_RUN_TOKENS, KVCacheManager
from engine.model_info import ModelInfo
from engine.model_runner import ModelRunner
from engine.models.loader import load_model
from engine.models.ops import select_ops
from engine.outputs import FinishReason, Logprob, PositionLogprobs
from engine.platform import resolve_device
from engine.prefill_lane import HELP_COST_SMOOTHING, LaneResult, PrefillLane
from engine.remote_kv import KVExport, KVExporter, KVFailurePolicy, KVImporter, PrefillTiming
from engine.request import ErrorScope, Request, RequestStatus, RequestTimes
from engine.request_queue import SchedulingPolicy
from engine.sampling_params import InvalidParam, SamplingParams
from engine.scheduler import Scheduler, TokenUpdate
from engine.scheduler_types import SampledToken, TokenLogprobs
from engine.step_budget import StepShape, moving_average
from engine.step_log import StepLog


def _outside_vocab(ids, vocab: int) -> list:
    """The first five ids that are not integers in [0, vocab) (none: an empty list)."""
    return [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab][:5]


@dataclass(frozen=True, slots=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: str
    new_token_ids: list[int]  # [0 or 1]
    new_logprobs: list[PositionLogprobs]  # one per new token, when asked
    new_prompt_logprobs: list[PositionLogprobs | None]  # prompt positions scored this step
    text_delta: str  # newly safe-to-show text
    finish_reason: FinishReason | None  # None: still running
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_cached_tokens: int
    error: str | None = None  # why the request failed (finish_reason ERROR)
    error_scope: ErrorScope | None = None  # with error: whose fault it was
    kv_recomputed: bool = False  # its remote KV failed and the prompt was prefilled here
    times: RequestTimes | None = None  # on the last output: when it passed each point here
    num_preemptions: int = 0  # on the last output: how often the scheduler preempted it here

    @classmethod
    def failed(cls, request_id: str, error: str, scope: ErrorScope, num_cached_tokens: int = 0,
               times: RequestTimes | None = None) -> EngineCoreOutput:
        """The last output of a request that failed: no new tokens, why, and whose fault."""
        return cls(request_id, [], [], [], "", FinishReason.ERROR, None, num_cached_tokens, error=error,
                   error_scope=scope, times=times)

    @classmethod
    def aborted(cls, request_id: str, text_delta: str, num_cached_tokens: int,
                times: RequestTimes | None) -> EngineCoreOutput:
        """The last output of a cancelled request: the text held back so far, flushed."""
        return cls(request_id, [], [], [], text_delta, FinishReason.ABORT, None, num_cached_tokens, times=times)


@dataclass(frozen=True, slots=True)
class KVLanding:
    """When a remote prefill's KV reached this process, and what its sender measured."""

    landed_at: float  # time.monotonic() when the first token (the last message) arrived
    first_chunk_at: float | None = None  # ... and the first KV chunk (None: the transport did not say)
    sender: PrefillTiming = PrefillTiming()


@dataclass(slots=True)
class EngineCounters:
    """Work done since the engine started (workers report these in Stats)."""

    num_prompt_tokens_computed: int = 0  # prompt positions this engine's model ran
    num_generation_tokens: int = 0  # tokens emitted (first tokens from remote prefill included)
    num_kv_recomputed: int = 0  # remote KV failed or expired; the prompt was prefilled here
    num_kv_failed: int = 0  # remote KV failed or expired under the fail policy
    max_num_running: int = 0  # most sequences scheduled in one step
    num_lane_prompts: int = 0  # prompts the prefill lane computed for requests still there (engine/prefill_lane.py)
    num_lane_prompt_tokens: int = 0  # their prompt positions (also in num_prompt_tokens_computed)
    lane_busy_s: float = 0.0  # the lane's time computing prompts (those aborted meanwhile too)
    lane_layers_helped: int = 0  # layers of the lane's prompts the engine thread computed (PrefillLane.help)


class EngineCore:
    def __init__(self, config: EngineConfig, info: ModelInfo, free_order_seed: int | None = None) -> None:
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.config = config
        self.info = info
        self.tokenizer = info.tokenizer
        model_cfg = config.model
        device = resolve_device(config.device)
        ops = select_ops(device)
        prefill = prefill_attention.for_model(model_cfg.arch, model_cfg.dtype, device) if ops.kernels else None
        backend = make_attention_backend(config.attention_backend, device, model_cfg.dtype, ops.kernels, prefill)
        self.model = load_model(model_cfg, backend, ops, device)  # first: on a GPU, the KV cache takes what is left
        num_blocks = num_blocks_for(model_cfg.arch, config.cache, model_cfg.dtype,
                                    (lambda: self._gpu_kv_budget(device)) if device.type == "cuda" else None)
        capacity = num_blocks * config.cache.block_size
        if capacity < model_cfg.max_model_len:
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({num_blocks} blocks of "
                f"{config.cache.block_size}) but max_model_len is {model_cfg.max_model_len}; "
                "raise num_kv_blocks / the KV memory budget or lower max_model_len"
            )
        runs = not envs.kv_runs_disabled()  # TANDEM_KV_RUNS=0: for comparisons
        self.block_pool = BlockPool(num_blocks, free_order_seed, neighbours=None if runs else False)
        namespace = namespace_digest(model_cfg.served_model_name, config.cache.block_size, str(model_cfg.dtype))
        self.kv_manager = KVCacheManager(
            self.block_pool, config.cache.block_size, namespace, config.cache.enable_prefix_caching,
            ahead_blocks=max(0, KV_RUN_TOKENS // config.cache.block_size - 1) if runs else 0,
        )
        self.kv_cache = KVCache(model_cfg.arch, num_blocks, config.cache.block_size, model_cfg.dtype, device,
                                triton=backend.uses_triton)
        graphs = None
        if wants_decode_graphs(device, backend, config.enforce_eager):
            graphs = DecodeGraphs(self.model, self.kv_cache, backend, config.scheduler.max_num_seqs,
                                  model_cfg.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, backend, graphs)
        self.scheduler = Scheduler(config.scheduler, self.kv_manager, model_cfg.max_model_len)
        self.kv_importer = KVImporter(self.kv_cache, self.kv_manager, model_cfg.arch.num_hidden_layers)
        self.kv_exporter = KVExporter()
        self.runner.on_layer_kv = self.kv_exporter.on_layer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.counters = EngineCounters()
        self._rng = random.Random(config.seed)
        # the prefill lane (engine/prefill_lane.py): on a CPU with threads to lend it one
        self.num_threads = torch.get_num_threads()  # this (the engine) thread's, between lane prompts
        self.lane: PrefillLane | None = None
        self._last_step_ms = 0.0  # the last forward's time (``_help_beside``)
        self._help_ms_per_token: float | None = None  # this thread's ms per token of a lane layer it read beside
        self.step_log = StepLog(path) if (path := envs.step_log_path()) else None  # TANDEM_STEP_LOG
        if config.scheduler.prefill_lane_min_tokens is not None and device.type == "cpu" and self.num_threads >= 2:
            self.lane = PrefillLane(ModelRunner(self.model, self.kv_cache, backend))
            self.scheduler.lane = self.lane

    def _gpu_kv_budget(self, device: torch.device) -> int:
        """KV bytes on this GPU, measured after the weights loaded (see gpu_kv_budget)."""
        free, total = torch.cuda.mem_get_info(device)
        config = self.config
        headroom = activation_headroom(config.model.arch, config.scheduler.max_num_batched_tokens,
                                       config.scheduler.max_num_seqs, config.model.dtype)
        return gpu_kv_budget(total, free, config.cache.gpu_memory_utilization, headroom)

    def warm_up(self) -> None:
        """Run one throwaway request (a short prompt and two decode steps) so that every kernel
        of the common path is compiled before the first real request: on a GPU, Triton compiles
        each kernel on its first launch. The prompt stays under one block, so nothing enters the
        prefix cache; counters start over afterwards. On a GPU it then captures the decode
        graphs of every batch bucket and split count (engine/decode_graphs.py), which compiles
        the split-K kernels too; with enforce_eager, split-K decode (chosen only for long
        contexts at small batches) compiles on its first use."""
        prompt = [0] * max(1, min(self.config.cache.block_size // 2, self.config.model.max_model_len - 3))
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, seed=0)
        self.add_request(self.make_request("tandem-warm-up", prompt, params))
        while self.has_unfinished_requests():
            self.step()
        if self.runner.decode_graphs is not None:
            self.runner.decode_graphs.capture_common()
        self.counters = EngineCounters()
        self.runner.num_forward_calls = self.runner.num_tokens_processed = 0

    # -- requests ----------------------------------------------------------------------------
    def make_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None,
        resume_token_ids: Sequence[int] = (), priority: int = 0,
    ) -> Request:
        """Validate and build a Request (nothing is allocated). ``resume_token_ids``: a
        migrated sequence's tokens already generated elsewhere (and sent to the client); they
        count as output (penalties, min/max tokens, positions of seeded draws, the text) and
        only what follows them is emitted."""
        max_len = self.config.model.max_model_len
        if not prompt_token_ids:
            raise InvalidParam("prompt", "the prompt is empty; give at least one token")
        vocab = self.config.model.arch.vocab_size
        bad = _outside_vocab(prompt_token_ids, vocab)
        if bad:
            raise InvalidParam("prompt", f"prompt token ids must be integers in [0, {vocab}); got {bad}")
        bad = _outside_vocab(params.stop_token_ids, vocab)
        if bad:
            raise InvalidParam("stop_token_ids", f"stop_token_ids must be in [0, {vocab}); got {bad}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > vocab:
                raise InvalidParam(name, f"{name} is {getattr(params, name)}; the vocabulary has {vocab} tokens")
        if len(prompt_token_ids) >= max_len:
            raise InvalidParam("prompt", 
                f"the prompt is {len(prompt_token_ids)} tokens long, but this model's context "
                f"(max_model_len) is {max_len} tokens, which must also fit at least one generated "
                "token; shorten the prompt or raise max_model_len"
            )
        room = max_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        eos = () if params.ignore_eos else self.info.eos_token_ids
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        if priority != 0 and self.config.scheduler.policy is not SchedulingPolicy.PRIORITY:
            raise InvalidParam("priority", f"priority {priority} needs the priority scheduling policy "
                                           "(--scheduling-policy priority); under fcfs every request has priority 0")
        request = Request(request_id, list(prompt_token_ids), params, seed, eos, max_tokens, cache_salt=cache_salt,
                          priority=priority)
        if resume_token_ids:
            if params.prompt_logprobs is not None:
                raise InvalidParam("prompt_logprobs", "a resumed sequence's prompt logprobs were sent before")
            self._check_resume(list(resume_token_ids), max_tokens, vocab)
            request.output_token_ids = list(resume_token_ids)
        return request

    @staticmethod
    def _check_resume(resume: list[int], max_tokens: int, vocab: int) -> None:
        bad = _outside_vocab(resume, vocab)
        if bad:
            raise InvalidParam("resume_token_ids", f"resumed token ids must be in [0, {vocab}); got {bad}")
        if len(resume) >= max_tokens:
            raise InvalidParam("resume_token_ids", f"{len(resume)} tokens resumed leave nothing to generate "
                                                   f"within max_tokens ({max_tokens})")

    def add_request(self, request: Request, kv_export: KVExport | None = None) -> None:
        """Queue a request computed here. With ``kv_export`` (prefill role) the KV of its
        prompt positions from ``kv_export.from_pos`` on goes to the sink, layer by layer."""
        if kv_export is not None:
            if not 0 <= kv_export.from_pos < request.num_prompt_tokens:
                raise ValueError(f"kv export from position {kv_export.from_pos} outside the prompt")
            request.kv_export_from = kv_export.from_pos
        self.scheduler.add_request(request)
        if kv_export is not None:
            self.kv_exporter.register(request.request_id, kv_export.sink)
        self._new_detokenizer(request)

    def _new_detokenizer(self, request: Request) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, request.sampling_params)
        detokenizer.replay(request.output_token_ids)  # a resumed sequence's text was sent before
        self._detokenizers[request.request_id] = detokenizer

    # -- decode role: the prompt's KV comes from elsewhere ----------------------------------
    def add_remote_request(
        self, request: Request, deadline_s: float, policy: KVFailurePolicy = KVFailurePolicy.RECOMPUTE
    ) -> int | None:
        """Reserve blocks and wait at most ``deadline_s`` for the prompt's KV (then ``policy``
        applies). Returns the number of leading prompt tokens already cached here (the sender
        starts there), or None when the blocks are not free now (nothing changed)."""
        num_cached = self.scheduler.add_remote_kv_request(request, deadline_s)
        if num_cached is None:
            return None
        self.kv_importer.expect(request.request_id, num_cached, request.num_prompt_tokens, policy)
        self._new_detokenizer(request)
        return num_cached

    def write_remote_kv(self, request_id: str, layer: int, start_pos: int, kv: torch.Tensor) -> None:
        """KV of positions [start_pos, start_pos + len(kv)) of one layer (checked, then written)."""
        self.kv_importer.write(request_id, layer, start_pos, kv)

    def finish_remote_kv(
        self, request_id: str, first_token: SampledToken, sender_cached_tokens: int = 0,
        landing: KVLanding | None = None,
    ) -> EngineCoreOutput:
        """All KV has landed: the request joins the batch with its first token. Raises
        (and leaves the request waiting) if any expected KV is missing.
        ``sender_cached_tokens``: prompt positions the sender reused rather than computed."""
        state = self.kv_importer.take_complete(request_id)
        update = self.scheduler.finish_remote_kv(request_id, first_token)
        update.request.num_cached_tokens = max(update.request.num_cached_tokens, sender_cached_tokens)
        times = update.request.times
        times.kv_bytes = state.num_bytes
        if landing is not None:
            times.kv_landed, times.kv_first_chunk = landing.landed_at, landing.first_chunk_at
            times.sender_queue_s, times.sender_prefill_s = landing.sender.queue_s, landing.sender.prefill_s
        self.counters.num_generation_tokens += len(update.new_token_ids)
        return self._process(update)

    def remote_kv_failed(self, request_id: str, reason: str) -> EngineCoreOutput | None:
        """The transfer failed (corrupt, refused, sender gone, late): what arrived is
        discarded and the request's policy applies. ``recompute`` queues it to prefill here
        (None: nothing to report yet); ``fail`` ends it with an error output. None as well
        if it was not waiting for KV (already running, finished or unknown)."""
        state = self.kv_importer.drop(request_id)
        if state is None:
            return None
        if state.policy is KVFailurePolicy.RECOMPUTE:
            self.scheduler.requeue_remote_kv(request_id)
            self.scheduler.requests[request_id].kv_recomputed = True
            self.counters.num_kv_recomputed += 1
            return None
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
        self._detokenizers.pop(request_id, None)
        self.counters.num_kv_failed += 1
        request.times.finished = time.monotonic()
        return EngineCoreOutput.failed(request_id, f"the prompt's KV transfer failed: {reason}",
                                       ErrorScope.KV_TRANSFER, request.num_cached_tokens, request.times)

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        detok = self._detokenizers.pop(request_id, None)
        self.kv_importer.drop(request_id)
        self.kv_exporter.close(request_id, FinishReason.ABORT)
        if self.lane is not None:
            self.lane.cancel(request_id)  # if it is still queued there, the lane skips it
        if request is None:
            return None
        request.times.finished = time.monotonic()
        return EngineCoreOutput.aborted(request_id, detok.take_delta(True) if detok else "",
                                        request.num_cached_tokens, request.times)

    def num_in_lane(self) -> int:
        """Requests whose prompt the lane holds now (computing, or queued there). The scheduler
        keeps them with those whose KV comes from a prefill worker, but no transfer is involved.
        Safe to read from another thread (Stats); a count taken mid-step may be one off."""
        if self.lane is None:
            return 0
        table = self.scheduler.waiting_for_remote_kv
        return sum(1 for request_id in list(self.lane.pending) if request_id in table)

    def stream_pace_ms(self) -> float:
        """The decoding streams' pace now (StreamPace: the mean ms between the ends of the steps
        that decoded, over the last 2 s), or 0.0 when fewer than two steps decoded in that
        window. The ``pace`` lane policy compares it with its bound. Safe to read from another
        thread (Stats)."""
        return self.scheduler.step_budget.pace.ms(time.monotonic()) or 0.0

    def num_waiting_for_remote_kv(self) -> int:
        """Requests whose prompt's KV is on its way from a prefill worker (not the lane's)."""
        return max(0, len(self.scheduler.waiting_for_remote_kv) - self.num_in_lane())

    def take_ready_outputs(self) -> list[EngineCoreOutput]:
        """Outputs that need no forward pass: the first tokens of prompts the lane finished,
        which join the batch now. A serving loop sends them before it steps, so that a first
        token does not wait for the next forward (a whole decode step, 40-100 ms on 2 cores);
        ``step`` takes any that are left. Nothing to do (and no thread count reset) while the
        lane holds no prompt."""
        return self._lane_finished() if self.lane is not None and self.lane.busy else []

    def has_unfinished_requests(self) -> bool:
        """Requests here, or a prompt in the lane (its result, or its aborted request's blocks, to take back)."""
        return self.scheduler.has_unfinished() or (self.lane is not None and self.lane.busy)

    # -- stepping ----------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        failed = [self.remote_kv_failed(request_id, "its KV did not arrive before the deadline")
                  for request_id in self.scheduler.expired_remote_kv(time.monotonic())]
        failed_outputs = [output for output in failed if output is not None]
        if self.lane is not None:
            failed_outputs += self._lane_finished()
            self._lane_start()
        scheduled = self.scheduler.schedule()
        if self.lane is not None and self.lane.busy:
            # with nothing to step, this thread computes the lane's prompt until there is again,
            # a layer per call; beside streams with slack, a layer of its second half per step
            if scheduled.seqs:
                self.lane.narrow()
                self._help_beside()
            else:
                self._help_lane()
        if not scheduled.seqs:
            return failed_outputs
        self._count_prompt_tokens(scheduled)
        now = time.monotonic()
        for seq in scheduled.seqs:
            times = self.scheduler.requests[seq.request_id].times
            if times.scheduled is None and times.first_token is None:  # its prompt starts computing here
                times.scheduled = now
        self.counters.max_num_running = max(self.counters.max_num_running, len(scheduled.seqs))
        started = time.perf_counter()
        lane_from = self._lane_computed()
        try:
            runner_output = self.runner.execute(scheduled)
        except Exception:
            # a failed forward must not strand the batch's blocks: fail those requests
            for seq in scheduled.seqs:
                self.scheduler.finish_request(seq.request_id, RequestStatus.FINISHED_ERROR)
                self._detokenizers.pop(seq.request_id, None)
                self.kv_exporter.close(seq.request_id, FinishReason.ERROR)
            raise
        elapsed_s, ended_at = time.perf_counter() - started, time.monotonic()
        self._last_step_ms = elapsed_s * 1000.0
        lane_share = 0.0 if lane_from is None else (self._lane_computed(ended_at) - lane_from) / max(elapsed_s, 1e-6)
        self.scheduler.step_budget.observe(StepShape(
            scheduled.num_decodes, scheduled.num_batched_tokens - scheduled.num_decodes, elapsed_s,
            ended_at=ended_at, lane_share=min(1.0, lane_share)))
        if self.step_log is not None:
            self.step_log.step(start=ended_at - elapsed_s, end=ended_at, decodes=scheduled.num_decodes,
                               prompt_tokens=scheduled.num_batched_tokens - scheduled.num_decodes,
                               lane_share=min(1.0, lane_share), waiting=len(self.scheduler.waiting),
                               in_lane=self.num_in_lane(),
                               prompt_ids=[seq.request_id for seq in scheduled.seqs
                                           if self.scheduler.requests[seq.request_id].times.first_token is None],
                               decode_tables=[seq.block_ids for seq in scheduled.seqs if len(seq.token_ids) == 1])
        updates = self.scheduler.update_from_output(scheduled, runner_output)
        failed_outputs += [self._fail(self.scheduler.requests[request_id], message)
                           for request_id, message in runner_output.failed.items()
                           if request_id in self.scheduler.requests]
        now = time.monotonic()
        for update in updates:  # prefill role: the prompt is done, its first token goes along
            request = update.request
            if request.kv_export_from is not None and update.new_token_ids and len(request.output_token_ids) == 1:
                scheduled_at = request.times.scheduled or now
                timing = PrefillTiming(max(0.0, scheduled_at - request.arrival_time), now - scheduled_at)
                self.kv_exporter.first_token(request.request_id, runner_output.sampled[request.request_id],
                                             request.num_cached_tokens, timing)
        outputs = [self._process(update) for update in updates]
        for output in outputs:
            self.counters.num_generation_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                self.kv_exporter.close(output.request_id, output.finish_reason)
        return failed_outputs + outputs

    # -- the prefill lane -------------------------------------------------------------------
    def _lane_computed(self, now: float | None = None) -> float | None:
        """The lane's time computing so far (``PrefillLane.computed_s``), or None without a lane."""
        return None if self.lane is None else self.lane.computed_s(time.monotonic() if now is None else now)

    def _lane_start(self) -> None:
        """Hand the lane the next long prompts while it has room and there are some; this
        thread lends it one of its threads while it holds any."""
        while self.lane.has_room and (seq := self.scheduler.take_for_lane()) is not None:
            self.kv_manager.pin(seq.request_id)
            self.lane.submit(seq)
        if self.lane.busy:
            torch.set_num_threads(self.num_threads - self.lane.threads)

    def _lane_finished(self) -> list[EngineCoreOutput]:
        """The prompts the lane finished join the batch with their first token (or fail
        alone); their blocks go back to the pool if they ended meanwhile."""
        outputs = []
        while (result := self.lane.take_done()) is not None:
            outputs += self._lane_result(result)
        if not self.lane.busy:
            torch.set_num_threads(self.num_threads)
            self.lane.narrow()  # it computes nothing: the next prompt starts on the lane's thread
        return outputs

    def _help_lane(self) -> None:
        """Nothing to step: compute the next layer of the lane's prompt here (PrefillLane.widen)."""
        self.lane.widen()
        self.counters.lane_layers_helped += self.lane.help(self.num_threads)

    def _help_beside(self) -> None:
        """Between two steps: read a layer of the second half of the lane's prompt on this
        thread if the streams can wait for it, that is if the last step and the layer (by this
        thread's measured ms per token of such layers) take at most ``prefill_lane_help_ms``
        together (engine/prefill_lane.py)."""
        bound = self.config.scheduler.prefill_lane_help_ms
        tokens = self.lane.beside_tokens() if bound is not None else None
        if tokens is None:
            return
        layer_ms = tokens * self._help_ms_per_token if self._help_ms_per_token is not None else 0.0
        if self._last_step_ms + layer_ms > bound:
            return
        started = time.perf_counter()
        if self.lane.help(self.num_threads, timeout_s=0.0):
            self.counters.lane_layers_helped += 1
            sample = (time.perf_counter() - started) * 1000.0 / tokens
            self._help_ms_per_token = moving_average(self._help_ms_per_token, sample, HELP_COST_SMOOTHING)

    def lane_wants_help(self) -> bool:
        """This thread holds the lane's prompt and it has layers left (the loop steps on)."""
        return self.lane is not None and self.lane.wants_help()

    def _lane_result(self, result: LaneResult) -> list[EngineCoreOutput]:
        request_id = result.seq.request_id
        self.kv_manager.unpin(request_id)
        self.counters.lane_busy_s += result.elapsed_s  # aborted meanwhile or not
        if self.step_log is not None:
            self.step_log.lane(end=result.started + result.elapsed_s, elapsed_s=result.elapsed_s,
                               tokens=len(result.seq.token_ids))
        request = self.scheduler.waiting_for_remote_kv.get(request_id)
        if request is None:
            return []  # aborted while the lane ran
        request.times.scheduled = request.times.scheduled or result.started  # its prompt started computing
        self.counters.num_prompt_tokens_computed += len(result.seq.token_ids)
        self.counters.num_lane_prompts += 1
        self.counters.num_lane_prompt_tokens += len(result.seq.token_ids)
        if result.error is not None:
            return [self._fail(request, f"the model step failed: {type(result.error).__name__}: {result.error}")]
        if request_id in result.output.failed:
            return [self._fail(request, result.output.failed[request_id])]
        update = self.scheduler.finish_remote_kv(request_id, result.output.sampled[request_id])
        self.counters.num_generation_tokens += len(update.new_token_ids)
        return [self._process(update)]

    def close(self) -> None:
        """Stop the lane's thread (the engine itself holds no other)."""
        if self.lane is not None:
            self.lane.stop()
        if self.step_log is not None:
            self.step_log.close()

    def _count_prompt_tokens(self, scheduled) -> None:
        for seq in scheduled.seqs:
            num_prompt = self.scheduler.requests[seq.request_id].num_prompt_tokens
            self.counters.num_prompt_tokens_computed += max(0, min(seq.start_pos + len(seq.token_ids), num_prompt) - seq.start_pos)

    def _fail(self, request: Request, message: str) -> EngineCoreOutput:
        """End one request with an error of its own; the rest of the batch is untouched."""
        if not request.status.is_finished:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        request.status = RequestStatus.FINISHED_ERROR
        self._detokenizers.pop(request.request_id, None)
        self.kv_exporter.close(request.request_id, FinishReason.ERROR)
        request.times.finished = time.monotonic()
        return EngineCoreOutput.failed(request.request_id, message, ErrorScope.REQUEST, request.num_cached_tokens,
                                       request.times)

    def _process(self, update: TokenUpdate) -> EngineCoreOutput:
        """Detokenize and apply stop strings; a failure there ends this request only."""
        try:
            return self._detokenize(update)
        except Exception as exc:
            return self._fail(update.request, f"detokenizing failed: {type(exc).__name__}: {exc}")

    def _detokenize(self, update: TokenUpdate) -> EngineCoreOutput:
        request = update.request
        detok = self._detokenizers[request.request_id]
        params = request.sampling_params
        # a stop token (EOS / stop_token_ids) is kept in token_ids but not in the text
        stopped_by_token = update.finished and request.status is RequestStatus.FINISHED_STOPPED
        for token_id in update.new_token_ids:
            if stopped_by_token and not params.include_stop_str_in_output:
                continue
            stop_string = detok.add_token(token_id)
            if stop_string is not None:
                if not request.status.is_finished:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = stop_string
        new_logprobs = [self._to_position(lp) for lp in update.new_logprobs]
        for position in new_logprobs:
            request.cumulative_logprob += position[request.output_token_ids[-1]].logprob
        request.logprobs.extend(new_logprobs)
        new_prompt_lp: list[PositionLogprobs | None] = [self._to_position(lp) for lp in update.new_prompt_logprobs]
        if new_prompt_lp and not request.prompt_logprobs:
            new_prompt_lp.insert(0, None)  # the first prompt token has no context to score it
        request.prompt_logprobs.extend(new_prompt_lp)
        finished = request.status.is_finished
        times = request.times
        if update.new_token_ids and times.first_token is None:
            times.first_token = time.monotonic()
            if self.step_log is not None:
                self.step_log.prompt(request_id=request.request_id, end=times.first_token,
                                     tokens=request.num_prompt_tokens - request.num_cached_tokens,
                                     arrival=request.arrival_time, scheduled=times.scheduled)
        if finished:
            self._detokenizers.pop(request.request_id, None)
            times.finished = time.monotonic()
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=update.new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=new_prompt_lp,
            text_delta=detok.take_delta(finished),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=request.num_cached_tokens,
            kv_recomputed=request.kv_recomputed,
            times=times if finished else None,
            num_preemptions=request.num_preemptions if finished else 0,
        )

    def _to_position(self, lp: TokenLogprobs) -> PositionLogprobs:
        entries: PositionLogprobs = {}
        for token_id, logprob, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            if token_id not in entries:
                entries[token_id] = Logprob(logprob, rank, self.tokenizer.token_text(token_id))
        return entries

    def check_integrity(self) -> None:
        self.kv_manager.check_integrity()
