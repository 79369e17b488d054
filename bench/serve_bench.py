"""`tandem bench serve`: load against any OpenAI-compatible server, with vLLM's definitions.

- TTFT: request sent -> first streamed event carrying text.
- ITL: every gap between streamed events carrying text, after the first.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1).
- E2E: request sent -> stream done.
- goodput: requests per second that finished and met every SLO given (failures are misses).
- prefix hit rate: usage.prompt_tokens_details.cached_tokens / usage.prompt_tokens, summed.
Arrivals are Poisson (``burstiness`` 1) or gamma, or as fast as ``max_concurrency`` allows.
Every request asks for ``ignore_eos`` (fixed output lengths); a server that ignores the field
shows up as requests that stopped short, counted and reported. A server that sends no usage
has its output tokens counted as streamed events carrying text (reported too)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.datasets import BenchRequest


@dataclass(slots=True)
class RequestResult:
    ok: bool
    send_delay_s: float  # how late the generator sent it against its schedule
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    requested_tokens: int = 0  # max_tokens (with ignore_eos, the length it should have)
    finish_reason: str = ""
    usage_reported: bool = False  # False: output_tokens counts streamed text events
    status: int = 0  # the HTTP status (429: refused by admission, e.g. shed)
    traffic_class: str | None = None  # --traffic-mix: the request's class

    @property
    def tpot_s(self) -> float | None:
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass(frozen=True, slots=True)
class LoadConfig:
    base_url: str  # ends in /v1
    model: str
    request_rate: float = float("inf")  # requests/s; inf sends all at once
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    ignore_eos: bool = True  # False for servers that refuse the field (see probe_ignore_eos)
    url: str | None = None  # where requests go; None: base_url + /completions (or /chat/completions)
    chat: bool = False  # /v1/chat/completions (the prompt as one user message) instead of /v1/completions
    sampling: dict[str, float] = field(default_factory=lambda: {"temperature": 0.0})  # body fields
    # --traffic-mix: class name -> the body fields its requests carry (none given: traffic_class=name)
    class_fields: dict[str, dict] = field(default_factory=dict)

    @property
    def request_url(self) -> str:
        return self.url or f"{self.base_url}/{'chat/completions' if self.chat else 'completions'}"

    def body(self, request: BenchRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, **self.sampling}
        if self.chat:
            body["messages"] = [{"role": "user", "content": request.prompt}]
        else:
            body["prompt"] = request.prompt
        if self.ignore_eos:
            body["ignore_eos"] = True
        if request.traffic_class is not None:
            body.update(self.class_fields.get(request.traffic_class, {"traffic_class": request.traffic_class}))
        return body


async def _one(client: httpx.AsyncClient, config: LoadConfig, request: BenchRequest, delay_s: float) -> RequestResult:
    body = config.body(request)
    result = RequestResult(ok=False, send_delay_s=delay_s, requested_tokens=request.max_tokens,
                           traffic_class=request.traffic_class)
    start = time.perf_counter()
    last = None
    text_events = 0
    try:
        async with client.stream("POST", config.request_url, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    return result
                now = time.perf_counter()
                choice = (event.get("choices") or [{}])[0]
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    text_events += 1
                if choice.get("finish_reason"):
                    result.finish_reason = choice["finish_reason"]
                if event.get("usage"):
                    result.usage_reported = True
                    usage = event["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        result.e2e_s = time.perf_counter() - start
        result.ok = last is not None
        if not result.usage_reported:
            result.output_tokens = text_events
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def probe_ignore_eos(base_url: str, model: str, api_key: str | None = None) -> bool:
    """Whether the server accepts vLLM's ``ignore_eos`` (some OpenAI-compatible servers refuse
    unknown fields with a 4xx naming it; those are then run without it, and reported)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "ignore_eos": True}
    response = httpx.post(f"{base_url}/completions", json=body, headers=headers, timeout=300)
    if response.status_code == 200:
        return True
    if 400 <= response.status_code < 500 and "ignore_eos" in response.text:
        return False
    raise RuntimeError(f"{base_url} answered a one-token completion with HTTP {response.status_code}: "
                       f"{response.text[:200]}")


def schedule(num: int, config: LoadConfig) -> list[float]:
    """Send offsets in seconds (gamma inter-arrivals with mean 1/rate)."""
    if config.request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(config.seed)
    shape = config.burstiness
    offsets, t = [], 0.0
    for _ in range(num):
        offsets.append(t)
        t += rng.gammavariate(shape, 1.0 / (config.request_rate * shape))
    return offsets


async def run_load(config: LoadConfig, requests: list[BenchRequest], progress: str | None = None,
                   offsets: list[float] | None = None) -> tuple[list[RequestResult], float]:
    """All requests on their schedule (``offsets``, seconds from the start; default: drawn
    from the config's rate); returns the results (in dataset order) and the duration.
    ``progress``: a label for a progress bar on stderr (None: no bar)."""
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limit = asyncio.Semaphore(config.max_concurrency or len(requests) or 1)
    limits = httpx.Limits(max_connections=(config.max_concurrency or len(requests)) + 4)
    bar = tqdm(total=len(requests), desc=progress, unit="req", file=sys.stderr, disable=progress is None,
               leave=False)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        start = time.perf_counter()

        async def scheduled(request: BenchRequest, offset: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
            async with limit:
                result = await _one(client, config, request, time.perf_counter() - start - offset)
            bar.update(1)
            return result

        try:
            offsets = schedule(len(requests), config) if offsets is None else offsets
            results = await asyncio.gather(*(scheduled(r, o) for r, o in zip(requests, offsets, strict=True)))
        finally:
            bar.close()
        return list(results), time.perf_counter() - start


def _stats_ms(values: list[float], percentiles: list[float] = ()) -> dict:
    """mean, std, p50/p90/p99 and ``percentiles`` (vLLM's --metric-percentiles, e.g. 99.9:
    nearest rank) in ms."""
    if not values:
        return {"mean": None, "std": None, "p50": None, "p90": None, "p99": None,
                "percentiles": {f"{p:g}": None for p in percentiles}}
    ordered = sorted(v * 1000 for v in values)
    return {"mean": statistics.fmean(ordered), "std": statistics.pstdev(ordered),
            "p50": nearest_rank(ordered, 0.5), "p90": nearest_rank(ordered, 0.9), "p99": nearest_rank(ordered, 0.99),
            "percentiles": {f"{p:g}": nearest_rank(ordered, p / 100) for p in percentiles}}


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of sorted, non-empty ``ordered``: the sample at the nearest rank."""
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summarize(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
              slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
              percentiles: list[float] = ()) -> dict:
    """vLLM's definitions (see the module docstring); a request meets the SLOs when it
    finished and each SLO given holds (TPOT of a one-token output counts as met)."""
    done = [r for r in results if r.ok]

    def meets_slo(r: RequestResult) -> bool:
        tpot = r.tpot_s
        return r.ok and (slo_ttft_ms is None or r.ttft_s * 1000 <= slo_ttft_ms) and (
            slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms) and (
            slo_e2e_ms is None or r.e2e_s * 1000 <= slo_e2e_ms)

    prompt_tokens = sum(r.prompt_tokens for r in done)
    short = [r for r in done if r.output_tokens < r.requested_tokens]
    return {
        "num_requests": len(results), "completed": len(done), "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens, "total_output_tokens": sum(r.output_tokens for r in done),
        "request_throughput": len(done) / duration_s if duration_s else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration_s if duration_s else 0.0,
        "goodput": sum(meets_slo(r) for r in results) / duration_s if duration_s else 0.0,
        "slo_attainment": sum(meets_slo(r) for r in results) / len(results) if results else 0.0,
        "ttft_ms": _stats_ms([r.ttft_s for r in done], percentiles),
        "tpot_ms": _stats_ms([r.tpot_s for r in done if r.tpot_s is not None], percentiles),
        "itl_ms": _stats_ms([gap for r in done for gap in r.itl_s], percentiles),
        "e2e_ms": _stats_ms([r.e2e_s for r in done], percentiles),
        "prefix_hit_rate": sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0.0,
        "max_send_delay_ms": max((r.send_delay_s for r in results), default=0.0) * 1000,
        "errors": sorted({r.error for r in results if r.error})[:5],
        # ignore_eos honoured: every request produced exactly the tokens it asked for
        "ignore_eos_honored": not short,
        "num_stopped_short": len(short),
        "usage_reported": all(r.usage_reported for r in done),
        "refused_429": sum(r.status == 429 for r in results),  # admission refused them (shed, or --max-queue)
        "samples_ms": {"ttft": [r.ttft_s * 1000 for r in done], "itl": [g * 1000 for r in done for g in r.itl_s],
                       "tpot": [r.tpot_s * 1000 for r in done if r.tpot_s is not None],
                       "e2e": [r.e2e_s * 1000 for r in done]},
    }


def summarize_classes(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None, slo_e2e_ms: float | None = None,
                      percentiles: list[float] = ()) -> dict[str, dict]:
    """``summarize`` per traffic class (--traffic-mix), over the whole run's duration."""
    names = sorted({r.traffic_class for r in results if r.traffic_class is not None})
    return {name: summarize([r for r in results if r.traffic_class == name], duration_s, slo_ttft_ms, slo_tpot_ms,
                            slo_e2e_ms, percentiles) for name in names}


def render_classes(classes: dict[str, dict]) -> str:
    lines = []
    for name, summary in classes.items():
        ttft, tpot, itl = summary["ttft_ms"], summary["tpot_ms"], summary["itl_ms"]
        cell = lambda stats, key: "-" if stats[key] is None else f"{stats[key]:.0f}"  # noqa: E731
        lines.append(f"  class {name}: {summary['completed']}/{summary['num_requests']} ok, "
                     f"{summary['refused_429']} refused (429), SLOs met by {summary['slo_attainment']:.0%}; "
                     f"TTFT p50/p90 {cell(ttft, 'p50')}/{cell(ttft, 'p90')} ms, TPOT p90 {cell(tpot, 'p90')} ms, "
                     f"ITL p99 {cell(itl, 'p99')} ms")
    return "\n".join(lines)


def render(label: str, summary: dict, percentile_metrics: list[str] = ("ttft", "tpot", "itl")) -> str:
    def fmt(stats: dict) -> str:
        return " / ".join("-" if stats[k] is None else f"{stats[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))

    keys = {"ttft": "ttft_ms", "tpot": "tpot_ms", "itl": "itl_ms", "e2el": "e2e_ms"}
    extra = [f"  {metric.upper()} ms " + ", ".join(f"p{name} {'-' if v is None else f'{v:.1f}'}"
                                                  for name, v in summary[keys[metric]]["percentiles"].items())
             for metric in percentile_metrics if metric in keys and summary[keys[metric]]["percentiles"]]
    return "\n".join([
        f"{label}: {summary['completed']}/{summary['num_requests']} ok in {summary['duration_s']:.1f} s, "
        f"{summary['request_throughput']:.2f} req/s, {summary['output_token_throughput']:.1f} tok/s, "
        f"goodput {summary['goodput']:.2f} req/s (SLOs met by {summary['slo_attainment']:.0%}), "
        f"prefix hit rate {summary['prefix_hit_rate']:.2f}, "
        f"generator at most {summary['max_send_delay_ms']:.0f} ms late",
        f"  TTFT ms mean/p50/p90/p99: {fmt(summary['ttft_ms'])}",
        f"  TPOT ms: {fmt(summary['tpot_ms'])}   ITL ms: {fmt(summary['itl_ms'])}   E2E ms: {fmt(summary['e2e_ms'])}",
    ] + extra + ([f"  errors: {summary['errors']}"] if summary["errors"] else [])
      + ([f"  note: ignore_eos not honoured: {summary['num_stopped_short']} requests stopped before max_tokens "
          "(output lengths differ from the workload's)"] if not summary["ignore_eos_honored"] else [])
      + (["  note: no usage in the stream: output tokens counted as streamed text events"]
         if not summary["usage_reported"] else []))


def to_json(summaries: dict[str, dict]) -> str:
    return json.dumps(summaries, indent=2, default=lambda o: asdict(o))


def ceiling_hit_rate(base_url: str, model: str, requests: list[BenchRequest], block_size: int = 16,
                     api_key: str | None = None) -> float:
    """The workload's best possible prefix hit rate: every group's shared prefix computed once
    (by its first request), then reused in whole blocks. Token counts from the server's
    /tokenize."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    root = base_url.removesuffix("/v1")
    with httpx.Client(timeout=60, headers=headers) as client:
        ids = [client.post(f"{root}/tokenize", json={"model": model, "prompt": r.prompt}).json()["tokens"]
               for r in requests]
    first_of_group: dict[int, list[int]] = {}
    reusable = 0
    for request, tokens in zip(requests, ids):
        first = first_of_group.setdefault(request.group, tokens) if request.group >= 0 else tokens
        if first is tokens:
            continue
        common = next((i for i, (a, b) in enumerate(zip(first, tokens)) if a != b), min(len(first), len(tokens)))
        reusable += min(common, len(tokens) - 1) // block_size * block_size
    return reusable / sum(len(t) for t in ids)


def metric_samples(base_url: str) -> list:
    """Every sample (``.name``, ``.labels``, ``.value``) of the server's Prometheus /metrics."""
    text = httpx.get(f"{base_url.removesuffix('/v1')}/metrics", timeout=10).text
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def worker_prompt_tokens_computed(base_url: str, role: str) -> float:
    """Summed over the role's workers, from the tandem router's /metrics."""
    return sum(s.value for s in metric_samples(base_url)
               if s.name == "tandem:worker_num_prompt_tokens_computed" and s.labels.get("role") == role)
