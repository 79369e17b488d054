"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
import time

BENCH_MODULES = ("bench.engine_bench", "bench.kv_transfer_bench", "bench.serve_cli", "bench.compare",
                 "bench.served_bench", "bench.router_bench", "bench.routing_bench", "bench.chaos", "bench.steps")


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
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name in BENCH_MODULES:  # each registers its own sub-command
        importlib.import_module(name).register(bench_commands, DEFAULT_MODEL)
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
