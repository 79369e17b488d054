"""`tandem bench engine --max-step-ms off,150,100,75`: what a step-time target costs and buys.

One engine, offline, per target: ``num_streams`` short prompts decode a long output while
long prompts arrive one every ``arrival_steps`` steps (the colocated worker's situation that
a time bound is for). Per target it reports the step times while streams decode (the
inter-token latency they see: p50, p99, max), the streams' mean time per output token, and
the long prompts' time to first token (from arrival to their first token). The same
requests, token for token, for every target.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepBenchConfig:
    model: str
    dtype: str
    threads: int
    targets_ms: tuple[float | None, ...]  # None: the token cap only
    num_streams: int = 8
    stream_prompt_len: int = 80
    stream_output_len: int = 320
    long_prompt_len: int = 1000
    num_long_prompts: int = 4
    arrival_steps: int = 60  # a long prompt arrives every this many steps
    max_num_batched_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class StepBenchRow:
    target_ms: float | None
    step_ms_p50: float  # steps while streams decode
    step_ms_p99: float
    step_ms_max: float
    stream_tpot_ms: float  # mean over streams of (last token - first token) / (tokens - 1)
    long_ttft_ms_mean: float  # arrival to first token, long prompts
    long_ttft_ms_max: float
    chunk_tokens_mean: float  # prompt tokens per step that computed some


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run_one(cfg: StepBenchConfig, target_ms: float | None) -> StepBenchRow:
    from engine import LLM, SamplingParams

    llm = LLM(model=cfg.model, dtype=cfg.dtype, num_threads=cfg.threads, max_step_ms=target_ms,
              max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=False)
    core = llm.engine_core
    rng = random.Random(0)
    vocab = core.config.model.arch.vocab_size

    def prompt(length: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(length)]

    stream = SamplingParams(temperature=0.0, max_tokens=cfg.stream_output_len, ignore_eos=True)
    single = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(cfg.num_streams):
        core.add_request(core.make_request(f"s{i}", prompt(cfg.stream_prompt_len), stream))
    long_prompts = [prompt(cfg.long_prompt_len) for _ in range(cfg.num_long_prompts)]
    arrived: dict[str, float] = {}
    first_token: dict[str, float] = {}
    token_times: dict[str, list[float]] = {}
    decoding_steps: list[float] = []
    step = 0
    while core.has_unfinished_requests():
        if step and step % cfg.arrival_steps == 0 and long_prompts:
            request_id = f"long{len(arrived)}"
            core.add_request(core.make_request(request_id, long_prompts.pop(0), single))
            arrived[request_id] = time.perf_counter()
        started = time.perf_counter()
        outputs = core.step()
        now = time.perf_counter()
        if any(o.request_id.startswith("s") and o.new_token_ids for o in outputs) and step > cfg.num_streams:
            decoding_steps.append((now - started) * 1000)
        for output in outputs:
            if output.new_token_ids:
                token_times.setdefault(output.request_id, []).append(now)
                first_token.setdefault(output.request_id, now)
        step += 1
    tpots = [(times[-1] - times[0]) / (len(times) - 1) * 1000 for rid, times in token_times.items()
             if rid.startswith("s") and len(times) > 1]
    ttfts = [(first_token[rid] - arrived[rid]) * 1000 for rid in arrived]
    budget = core.scheduler.step_budget
    return StepBenchRow(target_ms, _percentile(decoding_steps, 0.5), _percentile(decoding_steps, 0.99),
                        max(decoding_steps), statistics.fmean(tpots), statistics.fmean(ttfts), max(ttfts),
                        budget.chunk_sum / max(1, sum(budget.chunk_counts)))


def run_step_bench(cfg: StepBenchConfig, log=print) -> list[StepBenchRow]:
    rows = []
    for target in cfg.targets_ms:
        log(f"max_step_ms {target if target is not None else 'off'}")
        rows.append(run_one(cfg, target))
    return rows


def render_steps(cfg: StepBenchConfig, rows: list[StepBenchRow]) -> str:
    from bench.machine import describe

    lines = [describe(),
             f"{cfg.model} {cfg.dtype}, {cfg.threads} threads; {cfg.num_streams} streams ({cfg.stream_prompt_len} "
             f"prompt, {cfg.stream_output_len} out) decoding while a {cfg.long_prompt_len}-token prompt arrives "
             f"every {cfg.arrival_steps} steps ({cfg.num_long_prompts} in all); token cap "
             f"{cfg.max_num_batched_tokens}",
             "| --max-step-ms | step ms p50 / p99 / max (streams decoding) | stream TPOT ms | long-prompt TTFT ms "
             "mean / max | prompt tokens per step |", "|---|---|---|---|---|"]
    for row in rows:
        name = "off" if row.target_ms is None else f"{row.target_ms:g}"
        lines.append(f"| {name} | {row.step_ms_p50:.0f} / {row.step_ms_p99:.0f} / {row.step_ms_max:.0f} | "
                     f"{row.stream_tpot_ms:.1f} | {row.long_ttft_ms_mean:.0f} / {row.long_ttft_ms_max:.0f} | "
                     f"{row.chunk_tokens_mean:.0f} |")
    return "\n".join(lines)


def run_cli(args) -> int:
    """`tandem bench engine --max-step-ms ...` (its flags are registered by bench/engine_bench.py)."""
    from bench.report import log

    targets = tuple(None if t.strip() == "off" else float(t) for t in args.max_step_ms.split(","))
    cfg = StepBenchConfig(model=args.model, dtype=args.dtypes.split(",")[-1], threads=args.threads,
                          targets_ms=targets)
    print(render_steps(cfg, run_step_bench(cfg, log=log)))
    return 0
