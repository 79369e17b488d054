"""`tandem bench engine`: the engine against transformers on the same model, dtype and
threads, in one run, with the machine's memory bandwidth and the decode roofline.

Decode is memory-bound: each step reads every weight once, whatever the batch. So the
roofline for a step is (weight bytes + KV bytes read) / bandwidth, and the best torch can do
is the time its own matmul kernels take to read those weights (the "matmul ceiling").
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch

from bench.machine import describe, read_bandwidth


@dataclass(frozen=True, slots=True)
class EngineBenchConfig:
    model: str
    dtypes: tuple[str, ...]  # e.g. ("float32", "bfloat16")
    threads: int
    prompt_len: int  # prefill benchmark prompt
    batch_sizes: tuple[int, ...]
    decode_tokens: int  # tokens generated per sequence in the decode benchmark
    decode_prompt_len: int = 32
    with_transformers: bool = True
    seed: int = 0
    vllm_python: str | None = None  # the peers venv's python: vLLM's LLM.generate per batch, bfloat16/float32 alike
    prefill_repeats: int = 3  # the prompt is read this many times after a warm-up, by every side: the best counts


@dataclass(slots=True)
class Row:
    dtype: str
    metric: str  # "prefill" | "decode"
    batch: int
    tandem_tok_s: float
    transformers_tok_s: float | None
    matmul_ceiling_tok_s: float | None  # decode only
    roofline_tok_s: float | None  # decode only
    vllm_tok_s: float | None = None  # with --vllm-python

    @property
    def vllm_ratio(self) -> float | None:
        return self.tandem_tok_s / self.vllm_tok_s if self.vllm_tok_s else None

    @property
    def ratio(self) -> float | None:
        return self.tandem_tok_s / self.transformers_tok_s if self.transformers_tok_s else None

    @property
    def roofline_fraction(self) -> float | None:
        return self.tandem_tok_s / self.roofline_tok_s if self.roofline_tok_s else None


@dataclass(slots=True)
class EngineBenchResult:
    config: EngineBenchConfig
    bandwidth_gb_s: float
    auto_dtype: str
    machine: str
    rows: list[Row] = field(default_factory=list)
    weight_bytes: dict[str, int] = field(default_factory=dict)  # dtype -> bytes read per step
    gemm_peak_gflops: dict[str, float] = field(default_factory=dict)  # dtype -> the engine's Linear, large batch
    vllm_command: str = ""


def _random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (count, length), generator=generator).tolist()


def _weight_bytes(model) -> int:
    """Bytes of every matmul weight a decode step reads (layers and the output head)."""
    from engine.models.linear import Linear

    return sum(module.weight_nbytes for module in model.modules() if isinstance(module, Linear))


def _matmul_ceiling(model, batch: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Seconds per step that the step's weight matmuls alone take, with the engine's kernels."""
    from engine.models.linear import Linear

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    inputs = {m.in_features: torch.randn(batch, m.in_features).to(dtype) for m in linears}

    def step():
        for module in linears:
            module(inputs[module.in_features])

    with torch.inference_mode():
        step()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
    return best


def gemm_peak_gflops(model, dtype: torch.dtype, rows: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of the model's largest matmul with the engine's kernel at ``rows`` rows (a
    prefill-sized batch): the compute ceiling that large batches approach."""
    from engine.models.linear import Linear

    linear = max((m for m in model.modules() if isinstance(m, Linear)), key=lambda m: m.in_features * m.out_features)
    x = torch.randn(rows, linear.in_features).to(dtype)
    with torch.inference_mode():
        linear(x)
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            linear(x)
            best = min(best, time.perf_counter() - start)
    return 2 * rows * linear.in_features * linear.out_features / best / 1e9


def vllm_generate_tok_s(cfg: EngineBenchConfig, dtype: str, model_dir, batches: dict[int, list[list[int]]],
                        prefill_prompt: list[int] | None = None) -> tuple[dict[int, float], float | None, str]:
    """vLLM's offline ``LLM.generate`` (bench/peers/vllm_decode.py, mode generate), its OpenMP
    threads on the first ``cfg.threads`` cores: decode tok/s per batch, and prefill tok/s of
    ``prefill_prompt`` (None without one)."""
    import os
    import subprocess
    import tempfile

    prompt_len = len(prefill_prompt) if prefill_prompt else 0
    config = {"mode": "generate", "model": str(model_dir), "dtype": dtype, "new_tokens": cfg.decode_tokens,
              "max_model_len": max(cfg.decode_prompt_len + cfg.decode_tokens, prompt_len + 1) + 16,
              "max_batch": max(batches), "max_num_batched_tokens": max(8192, prompt_len),
              "cases": [{"batch": b, "prompts": p} for b, p in batches.items()],
              "prefill_prompt": prefill_prompt, "prefill_repeats": cfg.prefill_repeats}
    bind = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": "2"}
    script = os.path.join(os.path.dirname(__file__), "peers", "vllm_decode.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(config, handle)
        handle.flush()
        done = subprocess.run([cfg.vllm_python, script, handle.name], env={**os.environ, **bind},
                              capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed ({done.returncode}): {done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    command = " ".join([*(f"{k}={v}" for k, v in bind.items()), cfg.vllm_python, "bench/peers/vllm_decode.py",
                        "CONFIG.json (mode generate)"])
    prefill = next((line["prefill_tok_s"] for line in lines if "prefill_tok_s" in line), None)
    return {line["batch"]: line["decode_tok_s"] for line in lines if "batch" in line}, prefill, command


class _EngineRunner:
    """Drives one EngineCore directly, timing prefill and decode steps separately."""

    def __init__(self, cfg: EngineBenchConfig, dtype: str) -> None:
        from engine import LLM

        max_len = max(cfg.prompt_len, cfg.decode_prompt_len) + cfg.decode_tokens + 16
        self.llm = LLM(model=cfg.model, dtype=dtype, num_threads=cfg.threads, max_model_len=max_len,
                       max_num_seqs=max(cfg.batch_sizes), max_num_batched_tokens=max(cfg.prompt_len, 2048),
                       enable_prefix_caching=False)  # measure computing, not cache hits
        self.core = self.llm.engine_core
        self.cfg = cfg
        self._ids = 0

    def _add(self, prompts: list[list[int]], max_tokens: int) -> None:
        from engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in prompts:
            self._ids += 1
            self.core.add_request(self.core.make_request(f"bench-{self._ids}", prompt, params))

    def prefill_tok_s(self, prompt: list[int]) -> float:
        best = float("inf")
        for attempt in range(1 + self.cfg.prefill_repeats):  # the first at this length warms up
            self._add([prompt], 1)
            start = time.perf_counter()
            while self.core.has_unfinished_requests():
                self.core.step()
            if attempt:
                best = min(best, time.perf_counter() - start)
        return len(prompt) / best

    def decode_tok_s(self, prompts: list[list[int]]) -> float:
        self._add(prompts, self.cfg.decode_tokens)
        self.core.step()  # prefill every prompt and sample token 1
        steps = 0
        start = time.perf_counter()
        while self.core.has_unfinished_requests():
            self.core.step()
            steps += 1
        return len(prompts) * steps / (time.perf_counter() - start)


class _TransformersRunner:
    """transformers `generate` on the same checkpoint, dtype and thread count."""

    def __init__(self, model_dir, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()

    def _generate(self, input_ids: torch.Tensor, new_tokens: int) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )
        return time.perf_counter() - start

    def prefill_tok_s(self, prompt: list[int], repeats: int) -> float:
        ids = torch.tensor([prompt])
        self._generate(ids, 1)
        return len(prompt) / min(self._generate(ids, 1) for _ in range(repeats))

    def decode_tok_s(self, prompts: list[list[int]], new_tokens: int) -> float:
        ids = torch.tensor(prompts)
        prefill = self._generate(ids, 1)
        total = self._generate(ids, new_tokens)
        return len(prompts) * (new_tokens - 1) / max(total - prefill, 1e-9)


def run_engine_bench(cfg: EngineBenchConfig, log=print) -> EngineBenchResult:
    from engine.model_info import load_model_info
    from engine.platform import auto_dtype

    torch.set_num_threads(cfg.threads)
    info = load_model_info(cfg.model)
    bandwidth = read_bandwidth()
    log(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({cfg.threads} threads)")
    chosen = auto_dtype("cpu", info.arch.hidden_size, info.arch.intermediate_size)
    result = EngineBenchResult(cfg, bandwidth / 1e9, str(chosen).removeprefix("torch."), _machine())
    vocab = info.arch.vocab_size
    long_prompt = _random_prompts(1, cfg.prompt_len, vocab, cfg.seed)[0]
    arch = info.arch
    kv_bytes_per_token = 2 * arch.num_hidden_layers * arch.num_key_value_heads * arch.head_dim
    for dtype_name in cfg.dtypes:
        dtype = getattr(torch, dtype_name)
        log(f"[{dtype_name}] loading the engine")
        engine = _EngineRunner(cfg, dtype_name)
        hf = _TransformersRunner(info.model_dir, dtype) if cfg.with_transformers else None
        weight_bytes = _weight_bytes(engine.core.model)
        result.weight_bytes[dtype_name] = weight_bytes
        result.gemm_peak_gflops[dtype_name] = gemm_peak_gflops(engine.core.model, dtype)
        row = Row(dtype_name, "prefill", 1, engine.prefill_tok_s(long_prompt),
                  hf.prefill_tok_s(long_prompt, cfg.prefill_repeats) if hf else None, None, None)
        log(f"[{dtype_name}] prefill {cfg.prompt_len} tokens: {row.tandem_tok_s:.0f} tok/s")
        result.rows.append(row)
        batches = {batch: _random_prompts(batch, cfg.decode_prompt_len, vocab, cfg.seed + batch)
                    for batch in cfg.batch_sizes}
        for batch, prompts in batches.items():
            tandem = engine.decode_tok_s(prompts)
            theirs = hf.decode_tok_s(prompts, cfg.decode_tokens) if hf else None
            mean_context = cfg.decode_prompt_len + cfg.decode_tokens / 2
            step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token * dtype.itemsize
            roofline = batch / (step_bytes / bandwidth)
            ceiling = batch / _matmul_ceiling(engine.core.model, batch, dtype)
            result.rows.append(Row(dtype_name, "decode", batch, tandem, theirs, ceiling, roofline))
            log(f"[{dtype_name}] decode batch {batch}: {tandem:.1f} tok/s"
                + (f" (transformers {theirs:.1f})" if theirs else ""))
        del engine, hf
        if cfg.vllm_python:
            log(f"[{dtype_name}] vLLM's LLM.generate on the same prompts")
            theirs, prefill, result.vllm_command = vllm_generate_tok_s(cfg, dtype_name, info.model_dir, batches,
                                                                       long_prompt)
            for row in result.rows:
                if row.dtype == dtype_name:
                    row.vllm_tok_s = prefill if row.metric == "prefill" else theirs.get(row.batch)
    return result


def _machine() -> str:
    return describe()


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def render_table(result: EngineBenchResult) -> str:
    cfg = result.config
    lines = [
        f"model {cfg.model}; {cfg.threads} torch threads for each side; {result.machine}",
        f"memory read bandwidth {result.bandwidth_gb_s:.1f} GB/s; `auto` dtype here: {result.auto_dtype}; "
        f"prefill prompt {cfg.prompt_len} tokens (best of {cfg.prefill_repeats} after a warm-up, every side); "
        f"decode {cfg.decode_tokens} tokens after "
        f"{cfg.decode_prompt_len}-token prompts",
        "",
        "| dtype | workload | tandem tok/s | transformers tok/s | tandem / transformers | vLLM tok/s | tandem / vLLM "
        "| matmul ceiling tok/s | roofline tok/s | tandem / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        workload = f"prefill {cfg.prompt_len}" if row.metric == "prefill" else f"decode batch {row.batch}"
        ratio = "-" if row.ratio is None else f"{row.ratio:.2f}x"
        fraction = "-" if row.roofline_fraction is None else f"{row.roofline_fraction * 100:.0f}%"
        vllm_ratio = "-" if row.vllm_ratio is None else f"{row.vllm_ratio:.2f}x"
        lines.append(
            f"| {row.dtype} | {workload} | {row.tandem_tok_s:.1f} | {_fmt(row.transformers_tok_s, '.1f')} | "
            f"{ratio} | {_fmt(row.vllm_tok_s, '.1f')} | {vllm_ratio} | {_fmt(row.matmul_ceiling_tok_s, '.1f')} | "
            f"{_fmt(row.roofline_tok_s, '.1f')} | {fraction} |"
        )
    lines.append("")
    lines.append(
        "roofline = batch / ((weight bytes + KV bytes read per step) / bandwidth); matmul ceiling = "
        "batch / time of the step's weight matmuls alone with the engine's kernels. Weight bytes "
        "per step: " + ", ".join(f"{d} {b / 1e6:.0f} MB" for d, b in result.weight_bytes.items())
        + "; GEMM peak (the largest matmul, 1024 rows, the engine's kernel): "
        + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in result.gemm_peak_gflops.items())
    )
    if result.vllm_command:
        lines.append(f"vLLM: {result.vllm_command} (LLM.generate, timed as transformers is)")
    return "\n".join(lines)


def to_json(result: EngineBenchResult) -> str:
    data = asdict(result)
    for row, raw in zip(result.rows, data["rows"]):
        raw["ratio"] = row.ratio
        raw["roofline_fraction"] = row.roofline_fraction
        raw["vllm_ratio"] = row.vllm_ratio
    return json.dumps(data, indent=2)


def register(commands, default_model: str) -> None:
    """`tandem bench engine` (with ``--context-lens``: bench/context_bench.py; with
    ``--max-step-ms``: bench/step_bench.py)."""
    engine = commands.add_parser("engine", help="engine vs transformers, with the decode roofline")
    engine.add_argument("--model", default=default_model)
    engine.add_argument("--dtypes", default="float32,bfloat16")
    engine.add_argument("--threads", type=int, default=2, help="torch threads, the same for both sides")
    engine.add_argument("--prompt-len", type=int, default=1024)
    engine.add_argument("--batch-sizes", default="1,8,32")
    engine.add_argument("--decode-tokens", type=int, default=32)
    engine.add_argument("--no-transformers", action="store_true", help="skip the transformers reference")
    engine.add_argument("--out", help="write the results as JSON here")
    engine.add_argument("--context-lens", default=None,
                        help="comma-separated context lengths: ms per decode step at each, per batch size "
                             "(with --vllm-python, vLLM's offline engine beside tandem's)")
    engine.add_argument("--kv-scattered", action="store_true",
                        help="with --context-lens: also time tandem with its KV blocks scattered over a pool 4x "
                             "the cases' need (a worker that has served for a while), beside consecutive ones")
    engine.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python): "
                             "vLLM's offline engine beside tandem's (LLM.generate per batch size, or per "
                             "context length with --context-lens)")
    engine.add_argument("--max-step-ms", default=None,
                        help="comma-separated step-time targets ('off' for none): streams decoding while long "
                             "prompts arrive, per target (step times, TPOT, the prompts' TTFT)")
    engine.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from bench.report import comma_ints, log, print_and_save

    if args.context_lens:
        from bench.context_bench import run_cli as run_context

        return run_context(args)
    if args.max_step_ms:
        from bench.step_bench import run_cli as run_steps

        return run_steps(args)
    cfg = EngineBenchConfig(model=args.model, dtypes=tuple(args.dtypes.split(",")), threads=args.threads,
                            prompt_len=args.prompt_len, batch_sizes=comma_ints(args.batch_sizes),
                            decode_tokens=args.decode_tokens, with_transformers=not args.no_transformers,
                            vllm_python=args.vllm_python)
    result = run_engine_bench(cfg, log=log)
    return print_and_save(render_table(result), args.out, lambda: to_json(result))
