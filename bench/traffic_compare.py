"""`tandem bench compare --traffic-mix interactive:0.3,batch:0.7 --traffic-rate R`: issue 24's
benchmark. Each contender is started with priority scheduling (tandem: ``--scheduling-policy
priority --traffic-classes FILE`` and ``--tandem-args``; vLLM: ``--scheduling-policy
priority``), warmed up, then given two runs of the same seeded workload at ``R`` req/s:

- **baseline:** only the ``--traffic-baseline`` classes' requests (default: the mix's first
  class), at the times the whole mix sends them;
- **mixed:** every request.

tandem is sent each request's class by name (``traffic_class``), vLLM only ``priority``
(``--traffic-priorities``). The table gives each class's figures in both runs, and the
ratio of the mixed run's TTFT p90 and TPOT p90 to the baseline's.
"""

from __future__ import annotations

import asyncio
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from bench.compare import Contender, tandem_contender, vllm_contender
from bench.datasets import RandomSpec, make_dataset
from bench.serve_bench import LoadConfig, probe_ignore_eos, run_load, schedule, summarize, summarize_classes
from bench.traffic_mix import assign, body_fields, keep_only, parse_mix, parse_priorities


@dataclass(frozen=True)
class TrafficContender:
    contender: Contender
    class_fields: dict[str, dict]  # class -> the body fields its requests carry ({}: traffic_class by name)


def traffic_contenders(names: list[str], model: str, hf_dir: str, dtype: str, classes_file: str | None,
                       tandem_args: str, priorities: dict[str, int], vllm_python: str | None) -> list[TrafficContender]:
    """``colocated``, ``disagg`` (tandem, with the classes) and ``vllm`` (priority only)."""
    out = []
    for name in names:
        if name in ("colocated", "disagg"):
            if classes_file is None:
                raise ValueError("tandem contenders need --traffic-classes FILE with --traffic-mix")
            flags = ["--mode", name, "--scheduling-policy", "priority", "--traffic-classes", classes_file,
                     *shlex.split(tandem_args)]
            out.append(TrafficContender(tandem_contender(name, model, dtype, flags, f"tandem serve {' '.join(flags)}"),
                                        {}))
        elif name == "vllm":
            if not vllm_python:
                raise ValueError("the vllm contender needs --vllm-python (`make peers` makes .venv-peers/bin/python)")
            out.append(TrafficContender(vllm_contender(vllm_python, hf_dir, dtype, threads=2,
                                                       extra_args=["--scheduling-policy", "priority"]),
                                        body_fields("priority", priorities)))
        else:
            raise ValueError(f"--traffic-mix compares colocated, disagg and vllm, not {name!r}")
    return out


def run_traffic(contender: TrafficContender, requests, offsets, baseline: str, slo_ttft_ms, slo_tpot_ms,
                warm_up, seed: int, say=print) -> dict[str, dict]:
    """Start the contender; the baseline run, then the mixed run; per-class summaries of each."""
    runs: dict[str, dict] = {}
    with contender.contender.launch() as base_url:
        model = contender.contender.model
        ignore_eos = probe_ignore_eos(base_url, model)
        config = LoadConfig(base_url, model, seed=seed, ignore_eos=ignore_eos, class_fields=contender.class_fields)
        if warm_up:
            asyncio.run(run_load(LoadConfig(base_url, model, max_concurrency=2, ignore_eos=ignore_eos), list(warm_up)))
        only, only_offsets = keep_only(requests, offsets, baseline)
        for run, (batch, times) in {"baseline": (only, only_offsets), "mixed": (requests, offsets)}.items():
            results, duration = asyncio.run(run_load(config, batch, progress=f"{contender.contender.name} {run}",
                                                     offsets=times))
            runs[run] = {"all": summarize(results, duration, slo_ttft_ms, slo_tpot_ms),
                         "classes": summarize_classes(results, duration, slo_ttft_ms, slo_tpot_ms)}
            say(f"{contender.contender.name} {run}: {runs[run]['all']['completed']}/{len(batch)} ok in "
                f"{duration:.1f} s")
    return runs


def traffic_table(results: dict[str, dict[str, dict]]) -> str:
    """Markdown: per contender, run and class; the mixed run's TTFT p90 and TPOT p90 also as a
    ratio to the same class's in the baseline run."""
    lines = ["| server | run | class | completed | refused (429) | TTFT p50 / p90 (ms) | TPOT p90 (ms) | "
             "ITL p99 (ms) | TTFT p90, TPOT p90 vs baseline |", "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        for run, data in runs.items():
            for cls, s in data["classes"].items():
                base = runs.get("baseline", {}).get("classes", {}).get(cls) if run == "mixed" else None
                ratio = "-"
                if base and base["ttft_ms"]["p90"] and base["tpot_ms"]["p90"] and s["tpot_ms"]["p90"] is not None:
                    ratio = (f"{s['ttft_ms']['p90'] / base['ttft_ms']['p90']:.2f}x, "
                             f"{s['tpot_ms']['p90'] / base['tpot_ms']['p90']:.2f}x")
                lines.append(f"| {name} | {run} | {cls} | {s['completed']}/{s['num_requests']} | {s['refused_429']} | "
                             f"{_ms(s['ttft_ms']['p50'])} / {_ms(s['ttft_ms']['p90'])} | {_ms(s['tpot_ms']['p90'])} | "
                             f"{_ms(s['itl_ms']['p99'])} | {ratio} |")
    return "\n".join(lines)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def run_traffic_compare(args, hf_dir: str, names: list[str]) -> int:
    mix = parse_mix(args.traffic_mix)
    priorities = parse_priorities(args.traffic_priorities, mix) if "vllm" in names else {}
    spec = RandomSpec(args.random_input_len, args.random_output_len, args.random_range_ratio, args.random_prefix_len)
    requests = assign(make_dataset(args.dataset, args.num_prompts, args.seed, spec), mix, args.seed)
    offsets = schedule(len(requests), LoadConfig("", "", request_rate=args.traffic_rate, seed=args.seed))
    warm_up = make_dataset(args.dataset, args.warm_up, args.seed + 2000, spec)
    contenders = traffic_contenders(names, args.model, hf_dir, args.dtype, args.traffic_classes, args.tandem_args,
                                    priorities, args.vllm_python)
    baseline = args.traffic_baseline or next(iter(mix))
    results = {}
    for contender in contenders:
        print(f"== {contender.contender.name}: {contender.contender.description}")
        results[contender.contender.name] = run_traffic(contender, requests, offsets, baseline, args.slo_ttft_ms,
                                                        args.slo_tpot_ms, warm_up, args.seed)
    print(f"\n{args.dataset}, {len(requests)} requests at {args.traffic_rate:g} req/s (Poisson, seed {args.seed}), "
          f"mix {args.traffic_mix}; baseline: only {baseline}, at the same times")
    print(traffic_table(results))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "traffic.json").write_text(json.dumps({
        "dataset": args.dataset, "rate": args.traffic_rate, "mix": mix, "baseline": baseline, "seed": args.seed,
        "commands": {c.contender.name: " ".join(c.contender.command) for c in contenders},
        "runs": {name: {run: {"all": {k: v for k, v in data["all"].items() if k != "samples_ms"},
                              "classes": {cls: {k: v for k, v in s.items() if k != "samples_ms"}
                                          for cls, s in data["classes"].items()}}
                        for run, data in runs.items()} for name, runs in results.items()},
    }, indent=2))
    print(f"results in {out}/traffic.json")
    return 0
