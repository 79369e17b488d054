"""`tandem bench serve`'s command line: tandem's own flags and `vllm bench serve`'s.

A vLLM user's line runs unchanged: ``--base-url http://host:port`` (a trailing ``/v1`` is
accepted too) or ``--host``/``--port``, ``--endpoint`` (default ``/v1/completions``),
``--backend openai|vllm|openai-chat``, ``--dataset-name random`` with ``--random-input-len``,
``--random-output-len``, ``--random-range-ratio``, ``--random-prefix-len``, ``--goodput
ttft:MS tpot:MS e2el:MS``, ``--save-result --result-dir --result-filename``, ``--metric-
percentiles``, ``--percentile-metrics``, sampling flags, ``--served-model-name``, ``--label``,
``--metadata``, ``--disable-tqdm``. Flags vLLM has for its tokenizer (``--tokenizer``,
``--trust-remote-code``, ...) are accepted and not needed: prompts are built from words and
the server's usage counts the tokens. One difference is kept on purpose and printed: every
request asks for ``ignore_eos`` (fixed output lengths, as a benchmark should), so
``--ignore-eos`` is accepted and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import time

from bench.datasets import DATASETS, RandomSpec, make_dataset
from bench.traffic_mix import assign, body_fields, keep_only, parse_mix, parse_priorities

_BACKENDS = {"openai": "completions", "vllm": "completions", "openai-chat": "chat"}
_DEFAULT_ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def add_serve_bench_args(serve: argparse.ArgumentParser, default_model: str) -> None:
    serve.add_argument("--base-url", help="the server, http://host:port (a trailing /v1 is accepted); "
                       "default: --host and --port")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--endpoint", default=None, help="default /v1/completions (/v1/chat/completions with "
                       "--backend openai-chat)")
    serve.add_argument("--backend", choices=sorted(_BACKENDS), default="openai",
                       help="openai and vllm: /v1/completions; openai-chat: /v1/chat/completions")
    serve.add_argument("--model", default=default_model)
    serve.add_argument("--served-model-name", default=None, help="the model name requests carry (default --model)")
    serve.add_argument("--dataset", "--dataset-name", dest="dataset", default="shared-prefix", choices=list(DATASETS))
    serve.add_argument("--random-input-len", type=int, default=1024, help="random: mean prompt words (~tokens)")
    serve.add_argument("--random-output-len", type=int, default=128, help="random: mean output tokens")
    serve.add_argument("--random-range-ratio", type=float, default=0.0,
                       help="random: lengths uniform within +-this share of the means")
    serve.add_argument("--random-prefix-len", type=int, default=0, help="random: words every prompt starts with")
    serve.add_argument("--num-prompts", type=int, default=48)
    serve.add_argument("--request-rate", type=float, default=float("inf"))
    serve.add_argument("--sweep", help="comma-separated request rates: one run each (instead of --request-rate)")
    serve.add_argument("--plot-dir", help="write PNG plots here (latency CDFs; with --sweep, goodput and p99 ITL)")
    serve.add_argument("--burstiness", type=float, default=1.0)
    serve.add_argument("--max-concurrency", type=int, default=None)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument("--slo-ttft-ms", type=float, default=None)
    serve.add_argument("--slo-tpot-ms", type=float, default=None)
    serve.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                       help="vLLM's SLOs for goodput: ttft:MS tpot:MS e2el:MS")
    serve.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    serve.add_argument("--top-p", type=float, default=None)
    serve.add_argument("--top-k", type=int, default=None)
    serve.add_argument("--min-p", type=float, default=None)
    serve.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    serve.add_argument("--out", help="write the results as JSON here")
    serve.add_argument("--save-result", action="store_true", help="vLLM's: write vLLM-shaped JSON results")
    serve.add_argument("--result-dir", default=None)
    serve.add_argument("--result-filename", default=None)
    serve.add_argument("--label", default=None, help="names the result file (default: the backend)")
    serve.add_argument("--metadata", nargs="*", metavar="KEY=VALUE", default=None, help="stored in the result")
    serve.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99 (besides mean/p50/p90/p99)")
    serve.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    serve.add_argument("--disable-tqdm", action="store_true")
    serve.add_argument("--ignore-eos", action="store_true", help="accepted: every request asks for ignore_eos")
    for flag in ("--tokenizer", "--tokenizer-mode", "--dataset-path"):
        serve.add_argument(flag, default=None, help="accepted for vLLM's command lines; not needed")
    serve.add_argument("--trust-remote-code", action="store_true", help="accepted for vLLM's command lines")
    serve.add_argument("--traffic-mix", default=None, metavar="CLASS:SHARE,...",
                       help="draw each request into a traffic class (e.g. interactive:0.3,batch:0.7) and report "
                       "every metric per class (bench/traffic_mix.py)")
    serve.add_argument("--traffic-field", choices=("traffic_class", "priority"), default="traffic_class",
                       help="what the class travels as: tandem's traffic_class, or vLLM's priority alone")
    serve.add_argument("--traffic-priorities", default=None, metavar="CLASS:PRIORITY,...",
                       help="with --traffic-field priority: each class's priority (lower runs first)")
    serve.add_argument("--traffic-only", default=None, metavar="CLASS,...",
                       help="with --traffic-mix: send only these classes' requests, at the times the whole mix "
                       "would send them (a baseline with the same arrivals and none of the other traffic)")
    serve.add_argument("--compare-routing", action="store_true",
                       help="launch tandem serve with --routing-policy prefix, then round-robin; same workload")
    serve.add_argument("--serve-args", default="--mode disagg --prefill-workers 2 --local-prefill-max-tokens 0",
                       help="extra flags for the launched tandem serve (with --compare-routing)")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50`` -> {"ttft": 500.0, "tpot": 50.0}."""
    slos = {}
    for pair in pairs or []:
        key, _, value = pair.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY one of ttft, tpot, e2el; got {pair!r}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
    return slos


def server_url(args: argparse.Namespace) -> tuple[str, str]:
    """(base URL ending in /v1, the URL requests are posted to)."""
    root = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/").removesuffix("/v1")
    endpoint = args.endpoint or _DEFAULT_ENDPOINTS[_BACKENDS[args.backend]]
    return f"{root}/v1", root + "/" + endpoint.lstrip("/")


def _dataset(args: argparse.Namespace, seed: int) -> list:
    spec = RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len)
    return make_dataset(args.dataset, args.num_prompts, seed, spec)


class _Measure:
    """One load run against a server: its summary, printed as it ends."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.slos = parse_goodput(args.goodput)
        self.slo_ttft_ms = self.slos.get("ttft", args.slo_ttft_ms)
        self.slo_tpot_ms = self.slos.get("tpot", args.slo_tpot_ms)
        self.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
        self.model = args.served_model_name or args.model
        self.chat = _BACKENDS[args.backend] == "chat"
        self.mix = parse_mix(args.traffic_mix) if args.traffic_mix else None
        self.class_fields = body_fields(args.traffic_field, parse_priorities(args.traffic_priorities, self.mix)
                                        if self.mix and args.traffic_field == "priority" else None)

    def __call__(self, base_url: str, label: str, requests: list, prefill_side: bool = False,
                 rate: float | None = None, url: str | None = None) -> dict:
        from bench.serve_bench import (
            LoadConfig,
            ceiling_hit_rate,
            probe_ignore_eos,
            render,
            render_classes,
            run_load,
            schedule,
            summarize,
            summarize_classes,
            worker_prompt_tokens_computed,
        )

        args, model = self.args, self.model
        ignore_eos = probe_ignore_eos(base_url, model, args.api_key)
        config = LoadConfig(base_url, model, args.request_rate if rate is None else rate, args.burstiness,
                            args.max_concurrency, args.seed, args.api_key, ignore_eos, url=url, chat=self.chat,
                            sampling=_sampling(args), class_fields=self.class_fields)
        offsets = None
        if self.mix:
            requests = assign(requests, self.mix, args.seed)
            if args.traffic_only:
                requests, offsets = keep_only(requests, schedule(len(requests), config), args.traffic_only)
        computed_before = worker_prompt_tokens_computed(base_url, "prefill") if prefill_side else 0.0
        results, duration = asyncio.run(run_load(config, requests, progress=None if args.disable_tqdm else label,
                                                 offsets=offsets))
        summary = summarize(results, duration, self.slo_ttft_ms, self.slo_tpot_ms, self.slos.get("e2el"),
                            self.percentiles)
        if args.dataset == "shared-prefix":
            summary["ceiling_hit_rate"] = ceiling_hit_rate(base_url, model, requests, api_key=args.api_key)
        if prefill_side:  # what the prefill workers reused (usage also counts the decode worker's cache)
            time.sleep(1.5)  # a Stats poll after the last request
            computed = worker_prompt_tokens_computed(base_url, "prefill") - computed_before
            sent = sum(r.prompt_tokens for r in results if r.ok)
            summary["prefill_hit_rate"] = 1 - computed / sent if sent else 0.0
        text = render(label, summary, args.percentile_metrics.split(","))
        if self.mix:
            summary["classes"] = summarize_classes(results, duration, self.slo_ttft_ms, self.slo_tpot_ms,
                                                   self.slos.get("e2el"), self.percentiles)
            text += "\n" + render_classes(summary["classes"])
        print(text, flush=True)
        return summary


def run_serve_bench(args: argparse.Namespace) -> int:
    from bench.launch import LaunchedServe

    measure = _Measure(args)
    summaries = {}
    if args.compare_routing:
        for policy in ("prefix", "round-robin"):
            serve_args = ["--model", args.model, "--routing-policy", policy, *shlex.split(args.serve_args)]
            with LaunchedServe(serve_args) as base_url:
                summaries[policy] = measure(base_url, f"--routing-policy {policy}", _dataset(args, args.seed),
                                            prefill_side=True)
        _print_routing(summaries)
    else:
        base_url, url = server_url(args)
        if args.sweep:
            # fresh prompts at each rate: a later rate must not hit the prefix cache an earlier one filled
            rates = [float(rate) for rate in args.sweep.split(",")]
            summaries = {rate: measure(base_url, f"{rate:g} req/s", _dataset(args, args.seed + i), rate=rate, url=url)
                         for i, rate in enumerate(rates)}
        else:
            summaries["server"] = measure(base_url, url, _dataset(args, args.seed), url=url)
    _write_outputs(args, measure.model, summaries)
    return 0


def _write_outputs(args: argparse.Namespace, model: str, summaries: dict) -> None:
    """Plots (``--plot-dir``), tandem's JSON (``--out``) and vLLM's result files (``--save-result``)."""
    from bench.serve_bench import to_json

    if args.plot_dir:
        from bench import plots

        named = {str(name): summary for name, summary in summaries.items()}
        print(f"plots: {plots.latency_cdfs(named, f'{args.plot_dir}/latency_cdfs.png', args.dataset)}")
        if args.sweep:
            print(f"plots: {plots.sweep({'server': summaries}, f'{args.plot_dir}/sweep.png', args.dataset)}")
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(to_json(summaries))
    if args.save_result or args.result_filename:
        for name, summary in summaries.items():
            path = _result_path(args, model, name if args.sweep else args.request_rate)
            with open(path, "w") as handle:
                json.dump(vllm_result(summary, args, model), handle, indent=2)
            print(f"results: {path}")


def _sampling(args: argparse.Namespace) -> dict:
    fields = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return {k: v for k, v in fields.items() if v is not None}


def _print_routing(summaries: dict) -> None:
    prefix, rr = summaries["prefix"], summaries["round-robin"]
    print(f"prefix vs round-robin: prefill-worker hit rate {prefix['prefill_hit_rate']:.2f} vs "
          f"{rr['prefill_hit_rate']:.2f} (workload ceiling {prefix.get('ceiling_hit_rate', 0):.2f}), "
          f"usage hit rate {prefix['prefix_hit_rate']:.2f} vs {rr['prefix_hit_rate']:.2f}, "
          f"mean TTFT {prefix['ttft_ms']['mean']:.0f} vs {rr['ttft_ms']['mean']:.0f} ms, "
          f"p90 TTFT {prefix['ttft_ms']['p90']:.0f} vs {rr['ttft_ms']['p90']:.0f} ms")


def _result_path(args: argparse.Namespace, model: str, rate) -> str:
    """vLLM's naming: {label or backend}-{rate}qps[-concurrencyN]-{model}-{YYYYmmdd-HHMMSS}.json."""
    if args.result_filename and not args.sweep:
        name = args.result_filename
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.label or args.backend}-{float(rate)}qps{concurrency}-{model.split('/')[-1]}-{stamp}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    return name


def vllm_result(summary: dict, args: argparse.Namespace, model: str) -> dict:
    """The keys `vllm bench serve --save-result` writes (the ones scripts read), from our
    summary; tandem's whole summary rides along under ``tandem``."""
    result = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": model,
        "num_prompts": summary["num_requests"], "request_rate": args.request_rate, "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency, "duration": summary["duration_s"],
        "completed": summary["completed"], "failed": summary["failed"],
        "total_input_tokens": summary["total_input_tokens"], "total_output_tokens": summary["total_output_tokens"],
        "request_throughput": summary["request_throughput"],
        "request_goodput": summary["goodput"] if args.goodput or args.slo_ttft_ms or args.slo_tpot_ms else None,
        "output_throughput": summary["output_token_throughput"],
        "total_token_throughput": (summary["total_input_tokens"] + summary["total_output_tokens"])
        / summary["duration_s"] if summary["duration_s"] else 0.0,
    }
    for metric, key in (("ttft", "ttft_ms"), ("tpot", "tpot_ms"), ("itl", "itl_ms"), ("e2el", "e2e_ms")):
        stats = summary[key]
        result[f"mean_{metric}_ms"] = stats["mean"]
        result[f"median_{metric}_ms"] = stats["p50"]
        result[f"std_{metric}_ms"] = stats["std"]
        for name, value in stats["percentiles"].items():
            result[f"p{name}_{metric}_ms"] = value
    result.update(dict(item.split("=", 1) for item in args.metadata or [] if "=" in item))
    result["tandem"] = {k: v for k, v in summary.items() if k != "samples_ms"}
    return result


def register(commands, default_model: str) -> None:
    serve = commands.add_parser("serve", help="load against an OpenAI-compatible server (vLLM's metrics and "
                                "`vllm bench serve`'s flags)")
    add_serve_bench_args(serve, default_model)
    serve.set_defaults(func=run_serve_bench)
