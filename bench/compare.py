"""`tandem bench compare`: one workload, one sweep of request rates, against several servers
started one after another on this machine, side by side.

Contenders: `tandem serve --mode disagg` (one prefill and one decode worker, one thread each),
`tandem serve --mode colocated` (one worker, two threads, chunked prefill at each token budget
given), and Hugging Face `transformers serve --continuous-batching` on the same weights (the
HF directory tandem converted from the GGUF) and dtype. The TPOT SLO defaults to 3x the
unloaded decode step of the disaggregated server, measured first in the same run with three
requests of the same workload sent one at a time.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.datasets import BenchRequest, make_dataset
from bench.launch import LaunchedCommand, LaunchedServe, free_port
from bench.serve_bench import LoadConfig, metric_samples, probe_ignore_eos, run_load, summarize


@dataclass(frozen=True)
class Contender:
    name: str
    description: str  # threads, flags: what the table's reader needs to know
    command: list[str]
    launch: Callable[[], object]  # a context manager whose __enter__ gives the base URL (.../v1)
    model: str  # the model name requests carry


def tandem_contender(name: str, model: str, dtype: str, extra: list[str], description: str) -> Contender:
    args = ["--model", model, "--dtype", dtype, "--served-model-name", "bench", *extra]
    server = LaunchedServe(args)
    return Contender(name, description, ["tandem", "serve", *args], lambda: server, "bench")


def transformers_contender(hf_dir: str, dtype: str, threads: int) -> Contender:
    executable = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
    port = free_port()
    command = [executable, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, hf_dir]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    launched = LaunchedCommand(command, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1", env=env)
    return Contender("transformers", f"transformers serve --continuous-batching, {threads} threads", command,
                     lambda: launched, hf_dir)


def stage_totals(base_url: str) -> dict[str, tuple[float, float]] | None:
    """tandem's ``tandem:stage_latency_seconds`` (sum, count) per stage from /metrics; None for
    a server without them."""
    import httpx

    try:
        samples = metric_samples(base_url)
    except (httpx.HTTPError, ValueError):  # no /metrics, or not Prometheus text
        return None
    sums = {s.labels["stage"]: s.value for s in samples if s.name == "tandem:stage_latency_seconds_sum"}
    counts = {s.labels["stage"]: s.value for s in samples if s.name == "tandem:stage_latency_seconds_count"}
    return {stage: (total, counts.get(stage, 0.0)) for stage, total in sums.items()} or None


def stage_means_ms(before, after) -> dict[str, float] | None:
    """Mean milliseconds per stage over what happened between two ``stage_totals``."""
    if not after:
        return None
    before = before or {}
    means = {}
    for stage, (total, count) in after.items():
        total0, count0 = before.get(stage, (0.0, 0.0))
        if count > count0:
            means[stage] = (total - total0) / (count - count0) * 1000
    return means


def unloaded_decode_step_ms(base_url: str, model: str, requests: list[BenchRequest]) -> float:
    """Median TPOT of ``requests`` sent one at a time: the decode step with nothing else
    running, at the workload's own context lengths (a 1k-token context makes each step read
    that much more KV than a short one)."""
    results, _ = asyncio.run(run_load(LoadConfig(base_url, model, max_concurrency=1), requests))
    tpots = [r.tpot_s * 1000 for r in results if r.ok and r.tpot_s is not None]
    if not tpots:
        raise RuntimeError(f"could not measure the unloaded decode step: {[r.error for r in results]}")
    return statistics.median(tpots)


@dataclass
class CompareResult:
    slo_tpot_ms: float
    slo_ttft_ms: float | None
    unloaded_step_ms: float
    runs: dict[str, dict[float, dict]]  # contender -> request rate -> summary
    descriptions: dict[str, str]
    notes: dict[str, list[str]]


def compare(contenders: list[Contender], workloads: list[list[BenchRequest]], rates: list[float], seed: int,
            slo_tpot_ms: float | None, slo_ttft_ms: float | None, calibration: list[BenchRequest],
            say=print) -> CompareResult:
    """Each contender in turn: start it, run ``workloads[i]`` at ``rates[i]`` for every i, stop
    it. Each rate has its own prompts (else a later rate would hit the prefix cache the
    earlier one filled), the same for every contender. The first contender also calibrates
    the TPOT SLO when none is given."""
    runs: dict[str, dict[float, dict]] = {}
    notes: dict[str, list[str]] = {}
    unloaded = 0.0
    for index, contender in enumerate(contenders):
        say(f"== {contender.name}: {contender.description}")
        with contender.launch() as base_url:
            ignore_eos = probe_ignore_eos(base_url, contender.model)
            notes[contender.name] = [] if ignore_eos else ["refuses ignore_eos: output lengths vary"]
            if index == 0:
                unloaded = unloaded_decode_step_ms(base_url, contender.model, calibration)
                slo_tpot_ms = slo_tpot_ms or 3 * unloaded
                say(f"unloaded decode step {unloaded:.1f} ms -> TPOT SLO {slo_tpot_ms:.1f} ms")
            runs[contender.name] = {}
            for rate, requests in zip(rates, workloads, strict=True):
                config = LoadConfig(base_url, contender.model, rate, seed=seed, ignore_eos=ignore_eos)
                stages_before = stage_totals(base_url)
                results, duration = asyncio.run(run_load(config, requests, progress=f"{contender.name} @ {rate}/s"))
                summary = summarize(results, duration, slo_ttft_ms, slo_tpot_ms)
                summary["stages_ms"] = stage_means_ms(stages_before, stage_totals(base_url))
                runs[contender.name][rate] = summary
                say(_line(contender.name, rate, summary))
    return CompareResult(slo_tpot_ms, slo_ttft_ms, unloaded, runs, {c.name: c.description for c in contenders}, notes)


def _line(name: str, rate: float, s: dict) -> str:
    stages = s.get("stages_ms")
    where = ("\n" + " " * 16 + "mean per stage: " + ", ".join(f"{k} {v:.0f} ms" for k, v in stages.items())
             if stages else "")
    return (f"{name:>14} @ {rate:g} req/s: goodput {s['goodput']:.3f} req/s, p99 ITL {_ms(s['itl_ms']['p99'])}, "
            f"p90 TTFT {_ms(s['ttft_ms']['p90'])}, {s['output_token_throughput']:.1f} tok/s, "
            f"{s['completed']}/{s['num_requests']} ok{where}")


def _num(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def table(result: CompareResult, reference: str) -> str:
    """Markdown: one row per contender and rate, ratios against ``reference`` at the same rate."""
    lines = ["| server | rate (req/s) | goodput (req/s) | vs " + reference + " | p99 ITL (ms) | p90 TTFT (ms) "
             "| output tok/s |", "|---|---|---|---|---|---|---|"]
    for name, by_rate in result.runs.items():
        for rate, s in by_rate.items():
            base = result.runs.get(reference, {}).get(rate)
            if name == reference:
                ratio = "1.00x"
            elif base and s["goodput"]:
                ratio = f"{base['goodput'] / s['goodput']:.2f}x"
            else:
                ratio = "inf" if base else "-"
            lines.append(f"| {name} | {rate:g} | {s['goodput']:.3f} | {ratio} | {_num(s['itl_ms']['p99'])} | "
                         f"{_num(s['ttft_ms']['p90'])} | {s['output_token_throughput']:.1f} |")
    return "\n".join(lines)


def default_contenders(model: str, hf_dir: str, dtype: str, colocated_budgets: list[int],
                       with_transformers: bool) -> list[Contender]:
    contenders = [tandem_contender(
        "disagg", model, dtype, ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1",
                                 "--worker-threads", "1"],
        "tandem serve --mode disagg: 1 prefill + 1 decode worker, 1 thread each")]
    for budget in colocated_budgets:
        contenders.append(tandem_contender(
            f"colocated-{budget}", model, dtype,
            ["--mode", "colocated", "--decode-workers", "1", "--worker-threads", "2", "--max-num-batched-tokens",
             str(budget)],
            f"tandem serve --mode colocated: 1 worker, 2 threads, chunked prefill {budget} tokens per step"))
    if with_transformers:
        contenders.append(transformers_contender(hf_dir, dtype, threads=2))
    return contenders


def run_compare(args) -> int:
    import json

    from bench import plots
    from engine.model_info import load_model_info

    hf_dir = str(load_model_info(args.model).model_dir)
    rates = [float(r) for r in args.sweep.split(",")]
    workloads = [make_dataset(args.dataset, args.num_prompts, args.seed + i) for i in range(len(rates))]
    budgets = [int(b) for b in args.colocated_budgets.split(",")]
    contenders = default_contenders(args.model, hf_dir, args.dtype, budgets, not args.no_transformers)
    calibration = make_dataset(args.dataset, 3, args.seed + 1000)  # prompts of their own, same shape
    result = compare(contenders, workloads, rates, args.seed, args.slo_tpot_ms, args.slo_ttft_ms, calibration)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from bench.machine import describe

    print(f"\n{describe()}\n{args.dataset}, {args.num_prompts} requests per rate (fresh prompts at each rate), "
          f"Poisson arrivals, seed {args.seed}; "
          f"TPOT SLO {result.slo_tpot_ms:.1f} ms (3x the unloaded decode step {result.unloaded_step_ms:.1f} ms)"
          + (f", TTFT SLO {result.slo_ttft_ms:.0f} ms" if result.slo_ttft_ms else ""))
    print(table(result, "disagg"))
    for name, notes in result.notes.items():
        for note in notes:
            print(f"note: {name} {note}")
    (out / "compare.json").write_text(json.dumps({
        "machine": describe(), "dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
        "rates": rates,
        "slo_tpot_ms": result.slo_tpot_ms, "slo_ttft_ms": result.slo_ttft_ms,
        "unloaded_step_ms": result.unloaded_step_ms, "descriptions": result.descriptions, "notes": result.notes,
        "runs": {name: {str(rate): s for rate, s in by_rate.items()} for name, by_rate in result.runs.items()},
    }, indent=2))
    plots.sweep(result.runs, out / "sweep.png", f"{args.dataset}: goodput and p99 ITL against request rate")
    top = max(rates)
    plots.latency_cdfs({name: by_rate[top] for name, by_rate in result.runs.items()}, out / "latency_cdfs.png",
                       f"{args.dataset} at {top:g} req/s")
    print(f"results and plots in {out}/ (compare.json, sweep.png, latency_cdfs.png)")
    return 0
