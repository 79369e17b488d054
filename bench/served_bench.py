"""`tandem bench served`: what the serving path adds to the engine's decode step, for tandem
and for vLLM, in one run.

For each stream count N (``--streams``, default 1,8,32): N prompts of ``prompt_len`` random
token ids (the same ids everywhere) are sent at once, each decoding ``output_len`` tokens
(greedy, ``ignore_eos``). TPOT of a request is (last token time - first token time) /
(tokens - 1); a cell is the median over the requests of all ``rounds``.

Four sides, the same thread count each:
- tandem engine: the offline engine stepped on this process's main thread;
- tandem served: `tandem serve --mode colocated --worker-threads T`, streamed over HTTP;
- vLLM engine: vLLM's offline ``LLMEngine.step`` (bench/peers/vllm_decode.py, peers venv);
- vLLM served: vLLM's OpenAI server, OpenMP on the same T cores.

All four are started (and warmed up alike: vLLM compiles on its first batches) before any is
measured, and the measurements interleave: round by round, stream count by stream count, side
by side, so that a machine that drifts (a shared VM's does, by tens of percent over minutes)
moves every column alike. While one side is measured, the processes of the others are stopped
(SIGSTOP, then SIGCONT and a settling pause), so each runs on a machine as quiet as if alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import select
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from bench.compare import tandem_contender, vllm_contender
from bench.cpu_noise import Noise, NoisySide
from bench.datasets import BenchRequest
from bench.machine import describe
from bench.report import PeerOptions, ratio
from bench.serve_bench import LoadConfig, run_load


@dataclass(frozen=True, slots=True)
class ServedBenchConfig(PeerOptions):
    model: str
    dtype: str = "bfloat16"
    threads: int = 2  # engine threads on every side
    streams: tuple[int, ...] = (1, 8, 32)
    prompt_len: int = 80
    output_len: int = 256
    rounds: int = 2
    noise: Noise | None = None  # --noise: each engine alone measured again beside it (bench/cpu_noise.py)


@dataclass(slots=True)
class ServedRow:
    streams: int
    tandem_engine_ms: float
    tandem_served_ms: float
    vllm_engine_ms: float | None = None
    vllm_served_ms: float | None = None
    tandem_noisy_ms: float | None = None  # the engine alone beside --noise
    vllm_noisy_ms: float | None = None

    @property
    def tandem_noise_cost(self) -> float | None:  # noisy / quiet: 1.10 is 10% slower beside the noise
        return ratio(self.tandem_noisy_ms, self.tandem_engine_ms)

    @property
    def vllm_noise_cost(self) -> float | None:
        return ratio(self.vllm_noisy_ms, self.vllm_engine_ms)

    @property
    def tandem_overhead(self) -> float | None:  # served / engine: 1.10 is 10% above the engine
        return ratio(self.tandem_served_ms, self.tandem_engine_ms)

    @property
    def vllm_overhead(self) -> float | None:
        return ratio(self.vllm_served_ms, self.vllm_engine_ms)

    @property
    def served_vs_vllm(self) -> float | None:  # tandem served / vLLM served: below 1 is faster
        return ratio(self.tandem_served_ms, self.vllm_served_ms)


@dataclass(slots=True)
class ServedBenchResult:
    config: ServedBenchConfig
    machine: str
    rows: list[ServedRow] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)  # how each side was started


def make_prompts(cfg: ServedBenchConfig, vocab: int) -> list[list[list[int]]]:
    """``rounds`` x max(streams) prompts; round r of N streams uses the first N of set r."""
    import random

    rng = random.Random(cfg.seed)
    return [[[rng.randrange(100, vocab - 100) for _ in range(cfg.prompt_len)] for _ in range(max(cfg.streams))]
            for _ in range(cfg.rounds)]


def request_tpots(first: dict, last: dict, count: Counter) -> list[float]:
    """Milliseconds per output token after the first, per request that made more than one."""
    return [(last[r] - first[r]) / (count[r] - 1) * 1000 for r in first if count[r] > 1]


class TandemEngineSide:
    """tandem's offline engine in this process (main thread, as `LLM` users run it)."""

    name = "tandem engine"

    def __init__(self, cfg: ServedBenchConfig) -> None:
        from engine import LLM

        self.llm = LLM(model=cfg.model, dtype=cfg.dtype, num_threads=cfg.threads, max_num_seqs=max(cfg.streams),
                       max_model_len=cfg.prompt_len + cfg.output_len + 16)
        self.command = f"engine.LLM(num_threads={cfg.threads}) stepped in the bench process"
        self._ids = iter(range(1 << 30))

    def measure(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        from engine import SamplingParams

        core = self.llm.engine_core
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            core.add_request(core.make_request(f"served-{next(self._ids)}", prompt, params))
        first, last, count = {}, {}, Counter()
        while core.has_unfinished_requests():
            outputs = core.step()
            now = time.perf_counter()
            for output in outputs:
                if output.new_token_ids:
                    first.setdefault(output.request_id, now)
                    last[output.request_id] = now
                    count[output.request_id] += len(output.new_token_ids)
        return request_tpots(first, last, count)

    def pause(self) -> None:  # idle between its own measurements: nothing runs
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        del self.llm
        gc.collect()


class _Processes:
    """Stop and continue a child process and everything it started (a server's workers)."""

    process: subprocess.Popen | None

    def _tree(self) -> list:
        import psutil

        if self.process is None or self.process.poll() is not None:
            return []
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def pause(self) -> None:
        for proc in self._tree():
            with contextlib.suppress(Exception):
                proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        for proc in self._tree():
            with contextlib.suppress(Exception):
                proc.send_signal(signal.SIGCONT)


class ServerSide(_Processes):
    """An OpenAI-compatible server started by this run, measured over HTTP."""

    def __init__(self, name: str, launched, model: str, command: str) -> None:
        self.name, self.launched, self.model, self.command = name, launched, model, command
        self.base_url = launched.start()
        self.process = launched.process

    def warm_up(self, prompts: list[list[int]]) -> None:
        asyncio.run(run_load(LoadConfig(self.base_url, self.model), [BenchRequest(p, 8, -1) for p in prompts]))

    def measure(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        results, _ = asyncio.run(run_load(LoadConfig(self.base_url, self.model, max_concurrency=len(prompts)),
                                          [BenchRequest(p, max_tokens, -1) for p in prompts]))
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{self.name}: {len(failed)} of {len(prompts)} requests failed: {failed[:3]}")
        return [r.tpot_s * 1000 for r in results if r.tpot_s is not None]

    def close(self) -> None:
        self.resume()
        self.launched.stop()


class VLLMEngineSide(_Processes):
    """vLLM's offline engine in the peers venv, answering one case per line (vllm_decode.py)."""

    name = "vllm engine"

    def __init__(self, cfg: ServedBenchConfig, hf_dir: str, warm_up: list[list[int]], timeout_s: float = 1800.0):
        config = {"mode": "tpot", "model": hf_dir, "dtype": cfg.dtype, "max_batch": max(cfg.streams),
                  "max_model_len": cfg.prompt_len + cfg.output_len + 16, "max_num_batched_tokens": 8192,
                  "warm_up": warm_up}
        self._config = tempfile.NamedTemporaryFile("w", suffix=".json")
        json.dump(config, self._config)
        self._config.flush()
        bind = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
        script = os.path.join(os.path.dirname(__file__), "peers", "vllm_decode.py")
        self.command = " ".join([*(f"{k}={v}" for k, v in bind.items()), cfg.vllm_python,
                                 "bench/peers/vllm_decode.py", "CONFIG.json (mode tpot)"])
        self.timeout_s = timeout_s
        self.process = subprocess.Popen([cfg.vllm_python, script, self._config.name], env={**os.environ, **bind},
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
        self._errors: list[str] = []
        threading.Thread(target=lambda: self._errors.extend(self.process.stderr), daemon=True).start()
        self._read()  # {"ready": true}

    def _read(self) -> dict:
        """The next JSON line on its stdout, within the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.process.stdout], [], [], 1.0)
            if ready:
                line = self.process.stdout.readline()
                if not line:
                    break
                if line.startswith("{"):
                    return json.loads(line)
            elif self.process.poll() is not None:
                break
        self.close()
        raise RuntimeError(f"vLLM's engine stopped answering: {''.join(self._errors[-30:])}")

    def measure(self, prompts: list[list[int]], max_tokens: int) -> list[float]:
        self.process.stdin.write(json.dumps({"prompts": prompts, "new_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return self._read()["tpot_ms"]

    def close(self) -> None:
        self.resume()
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self._config.close()


def measure_interleaved(sides: list, cfg: ServedBenchConfig, prompt_sets: list[list[list[int]]], say,
                        settle_s: float = 2.0) -> dict[str, dict[int, float]]:
    """Round by round, stream count by stream count, side by side, the others paused; the
    median TPOT per side and stream count."""
    tpots: dict[str, dict[int, list[float]]] = {side.name: {n: [] for n in cfg.streams} for side in sides}
    for side in sides:
        side.pause()
    for number, prompts in enumerate(prompt_sets):
        for n in cfg.streams:
            for side in sides:
                side.resume()
                time.sleep(settle_s)  # the timers that fired while it was stopped
                try:
                    tpots[side.name][n] += side.measure(prompts[:n], cfg.output_len)
                finally:
                    side.pause()
                say(f"  round {number + 1}, {n} streams, {side.name}: TPOT p50 "
                    f"{statistics.median(tpots[side.name][n]):.1f} ms so far")
    return {name: {n: statistics.median(values) for n, values in cells.items()} for name, cells in tpots.items()}


def run_served_bench(cfg: ServedBenchConfig, say=print) -> ServedBenchResult:
    from engine.models.fetch import resolve_model

    hf_dir = str(resolve_model(cfg.model))
    with open(os.path.join(hf_dir, "config.json")) as handle:
        vocab = json.load(handle)["vocab_size"]
    prompt_sets = make_prompts(cfg, vocab)
    warm = prompt_sets[0][: max(cfg.streams)]
    result = ServedBenchResult(cfg, describe())
    sides: list = []
    try:
        say(f"starting: tandem engine ({cfg.dtype}, {cfg.threads} threads)")
        engine = TandemEngineSide(cfg)
        sides.append(engine)
        engine.measure(warm, 8)
        tandem = tandem_contender("colocated", cfg.model, cfg.dtype,
                                  ["--mode", "colocated", "--worker-threads", str(cfg.threads)], "")
        sides.append(ServerSide("tandem served", tandem.launch(), tandem.model, " ".join(tandem.command)))
        if cfg.vllm_python:
            sides.append(VLLMEngineSide(cfg, hf_dir, warm))
            vllm = vllm_contender(cfg.vllm_python, hf_dir, cfg.dtype, cfg.threads)
            sides.append(ServerSide("vllm served", vllm.launch(), vllm.model,
                                    " ".join([*(f"{k}={v}" for k, v in vllm.env.items()), *vllm.command])))
        if cfg.noise is not None:
            sides += [NoisySide(side, cfg.noise) for side in list(sides) if not isinstance(side, ServerSide)]
        for side in sides:
            say(f"{side.name}: {side.command}")
            result.commands[side.name] = side.command
            if isinstance(side, ServerSide):
                side.warm_up(warm)
            side.pause()  # quiet while the next one starts
        cells = measure_interleaved(sides, cfg, prompt_sets, say)
    finally:
        for side in sides:
            side.close()
    def cell(name: str, n: int) -> float | None:
        return cells.get(name, {}).get(n)

    result.rows = [ServedRow(n, cells["tandem engine"][n], cells["tandem served"][n], cell("vllm engine", n),
                             cell("vllm served", n), cell("tandem engine + noise", n), cell("vllm engine + noise", n))
                   for n in cfg.streams]
    return result


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_served(result: ServedBenchResult) -> str:
    cfg = result.config
    lines = [f"TPOT p50 (ms), engine alone vs served, {cfg.prompt_len}-token prompts, {cfg.output_len} out, all "
             f"streams at once, {cfg.dtype}, {cfg.threads} engine threads each, {cfg.rounds} rounds; {result.machine}",
             "| streams | tandem engine | tandem served | served / engine | vLLM engine | vLLM served "
             "| served / engine | tandem / vLLM served |", "|---|---|---|---|---|---|---|---|"]
    for row in result.rows:
        lines.append(f"| {row.streams} | {_ms(row.tandem_engine_ms)} | {_ms(row.tandem_served_ms)} "
                     f"| {_ratio(row.tandem_overhead)} | {_ms(row.vllm_engine_ms)} | {_ms(row.vllm_served_ms)} "
                     f"| {_ratio(row.vllm_overhead)} | {_ratio(row.served_vs_vllm)} |")
    if cfg.noise is not None:
        lines += ["", f"TPOT p50 (ms), each engine alone, quiet and beside a process of {cfg.noise}",
                  "| streams | tandem engine | + noise | noisy / quiet | vLLM engine | + noise | noisy / quiet |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {row.streams} | {_ms(row.tandem_engine_ms)} | {_ms(row.tandem_noisy_ms)} "
                  f"| {_ratio(row.tandem_noise_cost)} | {_ms(row.vllm_engine_ms)} | {_ms(row.vllm_noisy_ms)} "
                  f"| {_ratio(row.vllm_noise_cost)} |" for row in result.rows]
    lines += [f"{name}: {command}" for name, command in result.commands.items()]
    return "\n".join(lines)


def to_json(result: ServedBenchResult) -> str:
    return json.dumps({"config": asdict(result.config), "machine": result.machine, "commands": result.commands,
                       "rows": [asdict(row) for row in result.rows]}, indent=2)


def register(commands, default_model: str) -> None:
    served = commands.add_parser("served", help="engine-alone vs served TPOT at 1/8/32 streams, tandem and vLLM")
    served.add_argument("--model", default=default_model)
    served.add_argument("--dtype", default="bfloat16")
    served.add_argument("--threads", type=int, default=2, help="engine threads, the same for every side")
    served.add_argument("--streams", default="1,8,32", help="comma-separated stream counts")
    served.add_argument("--prompt-len", type=int, default=80)
    served.add_argument("--output-len", type=int, default=256)
    served.add_argument("--rounds", type=int, default=2, help="times each stream count is run")
    served.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python)")
    served.add_argument("--out", help="write the results as JSON here")
    served.add_argument("--noise", type=Noise.parse, default=None,
                        help="RATE:US: also time each engine alone beside a process that wakes RATE times a second "
                             "and computes US microseconds each time (e.g. 900:150, 13.5%% of a core: about what "
                             "the router, the client and Ray use at 48 streams)")
    served.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from bench.report import comma_ints, log, print_and_save

    cfg = ServedBenchConfig(model=args.model, dtype=args.dtype, threads=args.threads,
                            streams=comma_ints(args.streams), prompt_len=args.prompt_len,
                            output_len=args.output_len, rounds=args.rounds, vllm_python=args.vllm_python,
                            noise=args.noise)
    result = run_served_bench(cfg, say=log)
    return print_and_save(render_served(result), args.out, lambda: to_json(result))
