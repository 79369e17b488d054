"""`tandem bench engine --context-lens`: milliseconds per decode step at each context length
and batch size, for tandem's engine and for vLLM's offline engine (from `make peers`), on the
same checkpoint, dtype, thread count and prompts, measured the same way: every sequence gets
its first token, then the median of the decode steps that follow (contexts grow by
``new_tokens`` during them). Prefix caching is off on both sides."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field

import torch

from bench.machine import describe
from bench.peers.step_timing import median_decode_step_ms
from bench.report import PeerOptions, ratio


@dataclass(frozen=True, slots=True)
class ContextBenchConfig(PeerOptions):
    model: str
    dtype: str  # "bfloat16" or "float32": the same on both sides
    threads: int
    context_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    new_tokens: int = 32  # decode steps timed per case
    max_case_tokens: int = 65536  # context x batch above this is skipped (prefill time, KV memory)
    # also time tandem with its KV blocks scattered over a pool 4x the cases' need (its free queue
    # shuffled), as they are on a worker that has served for a while; a fresh pool hands out
    # consecutive blocks
    scattered_kv: bool = False


@dataclass(slots=True)
class ContextRow:
    context: int
    batch: int
    tandem_ms: float
    vllm_ms: float | None = None  # the table's ratio: tandem / vLLM, below 1 is faster
    tandem_scattered_ms: float | None = None  # with --kv-scattered: the KV blocks scattered over the pool


@dataclass(slots=True)
class ContextBenchResult:
    config: ContextBenchConfig
    machine: str
    rows: list[ContextRow] = field(default_factory=list)
    vllm_command: list[str] = field(default_factory=list)


def make_cases(cfg: ContextBenchConfig, vocab: int) -> list[dict]:
    generator = torch.Generator().manual_seed(cfg.seed)
    cases = []
    for context in cfg.context_lens:
        for batch in cfg.batch_sizes:
            if context * batch > cfg.max_case_tokens:
                continue
            prompts = torch.randint(100, vocab - 100, (batch, context), generator=generator).tolist()
            cases.append({"context": context, "batch": batch, "prompts": prompts})
    return cases


def _engine_limits(cfg: ContextBenchConfig) -> dict:
    return {"max_model_len": max(cfg.context_lens) + cfg.new_tokens + 8, "max_batch": max(cfg.batch_sizes),
            "max_num_batched_tokens": 8192}


# the free queue's shuffle for --kv-scattered (any seed scatters; a fixed one repeats the layout)
SCATTER_SEED = 7


def tandem_step_ms(cfg: ContextBenchConfig, cases: list[dict], scattered: bool = False) -> list[float]:
    """tandem's median decode step per case; ``scattered``: its KV blocks come from a pool whose
    free queue is shuffled (``free_order_seed``), not handed out in order. With ``cfg.scattered_kv``
    both runs use the same pool size, 4x what the cases need."""
    from engine import LLM, SamplingParams

    limits = _engine_limits(cfg)
    blocks = (cfg.max_case_tokens + max(cfg.batch_sizes) * (cfg.new_tokens + 16)) // 16 + 64
    if cfg.scattered_kv:
        blocks *= 4
    llm = LLM(model=cfg.model, dtype=cfg.dtype, num_threads=cfg.threads, max_model_len=limits["max_model_len"],
              max_num_seqs=limits["max_batch"], max_num_batched_tokens=limits["max_num_batched_tokens"],
              num_kv_blocks=blocks, enable_prefix_caching=False, free_order_seed=SCATTER_SEED if scattered else None)
    core = llm.engine_core
    ids = iter(range(1 << 30))

    def run(prompts: list[list[int]], new_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for prompt in prompts:
            core.add_request(core.make_request(f"ctx-{next(ids)}", prompt, params))
        return median_decode_step_ms(core.step, core.has_unfinished_requests, len(prompts),
                                     lambda outputs: [o.request_id for o in outputs if o.new_token_ids])

    run([case["prompts"][0][:64] for case in cases[:1]], 4)  # warm-up
    return [run(case["prompts"], cfg.new_tokens) for case in cases]


def vllm_step_ms(cfg: ContextBenchConfig, cases: list[dict], hf_dir: str) -> tuple[list[float], list[str], dict]:
    """vLLM in its own venv (bench/peers/vllm_decode.py), pinned to the same number of cores."""
    config = {"model": hf_dir, "dtype": cfg.dtype, "new_tokens": cfg.new_tokens, **_engine_limits(cfg),
              "warm_up": [cases[0]["prompts"][0][:64]], "cases": cases}
    kv_gib = max(1, -(-(cfg.max_case_tokens + max(cfg.batch_sizes) * 64) * _kv_bytes_per_token(hf_dir) // (1 << 30)))
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": f"0-{cfg.threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_gib + 1)}
    script = os.path.join(os.path.dirname(__file__), "peers", "vllm_decode.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(config, handle)
        handle.flush()
        command = [cfg.vllm_python, script, handle.name]
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"vLLM failed ({done.returncode}): {done.stderr[-3000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    shown_env = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    return [line["step_ms"] for line in lines], command[:2] + ["CONFIG.json"], shown_env


def _kv_bytes_per_token(hf_dir: str) -> int:
    with open(os.path.join(hf_dir, "config.json")) as handle:
        arch = json.load(handle)
    head_dim = arch.get("head_dim") or arch["hidden_size"] // arch["num_attention_heads"]
    return 2 * arch["num_hidden_layers"] * arch["num_key_value_heads"] * head_dim * 2


def run_context_bench(cfg: ContextBenchConfig, log=print) -> ContextBenchResult:
    from engine.models.fetch import resolve_model

    hf_dir = str(resolve_model(cfg.model))
    with open(os.path.join(hf_dir, "config.json")) as handle:
        vocab = json.load(handle)["vocab_size"]
    cases = make_cases(cfg, vocab)
    result = ContextBenchResult(cfg, describe())
    log(f"tandem: {len(cases)} cases, {cfg.dtype}, {cfg.threads} threads")
    tandem = tandem_step_ms(cfg, cases)
    scattered: list[float | None] = [None] * len(cases)
    if cfg.scattered_kv:
        log("tandem: the same cases with the KV blocks scattered over the pool")
        scattered = tandem_step_ms(cfg, cases, scattered=True)
    vllm: list[float | None] = [None] * len(cases)
    if cfg.vllm_python:
        log(f"vLLM ({cfg.vllm_python}): the same cases")
        vllm, result.vllm_command, env = vllm_step_ms(cfg, cases, hf_dir)
        result.vllm_command = [f"{k}={v}" for k, v in env.items()] + result.vllm_command
    result.rows = [ContextRow(c["context"], c["batch"], t, v, k) for c, t, v, k in zip(cases, tandem, vllm, scattered)]
    return result


def render_context(result: ContextBenchResult) -> str:
    cfg = result.config
    scattered = cfg.scattered_kv
    extra = " tandem, KV scattered (ms/step) | scattered / in order |" if scattered else ""
    lines = [f"decode step at context length, {cfg.dtype}, {cfg.threads} threads each, "
             f"median of {cfg.new_tokens} steps; {result.machine}",
             "| context | batch | tandem ms/step | vLLM ms/step | tandem / vLLM |" + extra,
             "|---|---|---|---|---|" + ("---|---|" if scattered else "")]
    for row in result.rows:
        vllm = f"{row.vllm_ms:.1f}" if row.vllm_ms else "-"
        against = ratio(row.tandem_ms, row.vllm_ms)
        shown = f"{against:.2f}" if against else "-"
        line = f"| {row.context} | {row.batch} | {row.tandem_ms:.1f} | {vllm} | {shown} |"
        if scattered:
            slower = ratio(row.tandem_scattered_ms, row.tandem_ms)
            line += (f" {row.tandem_scattered_ms:.1f} | {slower:.2f} |" if row.tandem_scattered_ms and slower
                     else " - | - |")
        lines.append(line)
    if result.vllm_command:
        lines.append("vLLM: " + " ".join(result.vllm_command))
    return "\n".join(lines)


def run_cli(args) -> int:
    """`tandem bench engine --context-lens ...` (its flags are registered by bench/engine_bench.py)."""
    from bench.report import comma_ints, log, print_and_save

    cfg = ContextBenchConfig(model=args.model, dtype=args.dtypes.split(",")[-1],  # one dtype: the last given
                             threads=args.threads, context_lens=comma_ints(args.context_lens),
                             batch_sizes=comma_ints(args.batch_sizes), new_tokens=args.decode_tokens,
                             vllm_python=args.vllm_python, scattered_kv=args.kv_scattered)
    result = run_context_bench(cfg, log=log)
    return print_and_save(render_context(result), args.out, lambda: json.dumps({
        "config": asdict(cfg), "machine": result.machine, "vllm": result.vllm_command,
        "rows": [asdict(row) for row in result.rows]}, indent=2))
