"""A JSON line per engine step, for finding where a served step's time goes
(``TANDEM_STEP_LOG``, engine/envs.py). Off unless that is set; each line is written whole, with
the file line-buffered, so a worker killed mid-run leaves every step it finished.

Step lines: ``{"kind": "step", "end": monotonic s, "ms": the forward and sampling, "gap_ms":
from the previous step's end to this one's start, "decodes": sequences fed one token,
"prompt_tokens": the others' tokens, "lane_share": the share of the step the lane computed
beside it, "waiting": requests waiting for a step, "in_lane": prompts the lane holds, "kv_blocks":
the KV blocks the one-token sequences' attention reads, "kv_runs": how many runs of neighbouring
blocks (ascending or descending) those make: blocks a run is how scattered the KV is}``.
Lane lines: ``{"kind": "lane", "end", "ms": the prompt's time in the lane, "tokens": its
length}``. Prompt lines, one per request when its first token comes: ``{"kind": "prompt", "end",
"tokens": prompt tokens computed (less a prefix-cache hit), "queue_ms": arrival to its first
computation, "read_ms": from there to its first token, "steps": engine steps that computed some of
its prompt (0: the prefill lane read it, or another worker)}``. ``summarise`` groups a log's
steps by batch size; ``tandem bench steps LOG`` prints it, and the prompts by their steps."""

from __future__ import annotations

import gzip
import json
import os
import statistics
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from engine.step_budget import APART_FROM_LANE


class StepLog:
    def __init__(self, path: str) -> None:
        self.path = Path(path.replace("{pid}", str(os.getpid())))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (open for the engine's life)
        self._last_end: float | None = None
        self._prompt_steps: dict[str, int] = {}  # request id -> steps that computed some of its prompt so far

    def step(self, *, start: float, end: float, decodes: int, prompt_tokens: int, lane_share: float,
             waiting: int, in_lane: int, prompt_ids: Iterable[str] = (),
             decode_tables: Iterable[list[int]] = ()) -> None:
        kv_blocks = kv_runs = 0
        for table in decode_tables:
            kv_blocks += len(table)
            kv_runs += count_runs(table)
        for request_id in prompt_ids:
            self._prompt_steps[request_id] = self._prompt_steps.get(request_id, 0) + 1
        gap_ms = None if self._last_end is None else round((start - self._last_end) * 1000.0, 3)
        self._last_end = end
        self._write({"kind": "step", "end": round(end, 6), "ms": round((end - start) * 1000.0, 3), "gap_ms": gap_ms,
                     "decodes": decodes, "prompt_tokens": prompt_tokens, "lane_share": round(lane_share, 3),
                     "waiting": waiting, "in_lane": in_lane, "kv_blocks": kv_blocks, "kv_runs": kv_runs})

    def lane(self, *, end: float, elapsed_s: float, tokens: int) -> None:
        self._write({"kind": "lane", "end": round(end, 6), "ms": round(elapsed_s * 1000.0, 3), "tokens": tokens})

    def prompt(self, *, request_id: str, end: float, tokens: int, arrival: float, scheduled: float | None) -> None:
        scheduled = end if scheduled is None else scheduled
        self._write({"kind": "prompt", "end": round(end, 6), "tokens": tokens,
                     "queue_ms": round((scheduled - arrival) * 1000.0, 3),
                     "read_ms": round((end - scheduled) * 1000.0, 3), "steps": self._prompt_steps.pop(request_id, 0)})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def count_runs(table: list[int]) -> int:
    """Runs of neighbouring blocks in a block table: a new run wherever the next block is not
    next to the one before it (either way)."""
    return sum(1 for i, block_id in enumerate(table) if i == 0 or abs(block_id - table[i - 1]) != 1)


def _records(path: str | Path) -> list[dict]:
    """A log's lines (gzipped where its name ends in .gz, as kept under docs/bench)."""
    data = Path(path).read_bytes()
    if str(path).endswith(".gz"):
        data = gzip.decompress(data)
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]


def summarise(path: str | Path | list[dict], bucket: int = 10, part: tuple[int, int] | None = None) -> list[dict]:
    """A log's steps by batch size (decodes, in buckets of ``bucket``), apart for steps with
    prompt tokens and for steps the lane computed beside (for more than ``APART_FROM_LANE`` of
    the step): count, median ms, and for steps with
    prompt tokens the median ms per prompt token over the bucket's median step without any, and
    the one-token sequences' KV blocks a run of neighbouring blocks (``count_runs``). ``part``
    (i, n): only the i-th of n consecutive equal shares of the log's steps. ``path``: the log,
    or its records already read."""
    records = path if isinstance(path, list) else _records(path)
    steps = [r for r in records if r["kind"] == "step"]
    if part is not None:
        index, num_parts = part
        steps = steps[index * len(steps) // num_parts:(index + 1) * len(steps) // num_parts]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for record in steps:
        # beside the lane: any share above what the step budget still counts as apart from it
        key = (record["decodes"] // bucket, record["prompt_tokens"] > 0, record["lane_share"] > APART_FROM_LANE)
        groups[key].append(record)
    plain = {key[0]: statistics.median(r["ms"] for r in steps) for key, steps in groups.items()
             if not key[1] and not key[2]}
    rows = []
    for (band, with_prompt, beside_lane), steps in sorted(groups.items()):
        row = {"decodes": f"{band * bucket}-{band * bucket + bucket - 1}", "prompt": with_prompt,
               "beside_lane": beside_lane, "steps": len(steps),
               "median_ms": round(statistics.median(r["ms"] for r in steps), 1)}
        runs = sum(r.get("kv_runs", 0) for r in steps)  # (logs written before the field: none)
        if runs:
            row["blocks_per_run"] = round(sum(r["kv_blocks"] for r in steps) / runs, 2)
        if with_prompt and band in plain:
            row["ms_per_prompt_token"] = round(statistics.median(
                (r["ms"] - plain[band]) / r["prompt_tokens"] for r in steps), 3)
        rows.append(row)
    return rows


def report(path: str | Path, bucket: int = 10, parts: int = 1) -> str:
    """The summary as a markdown table, then the time between steps and the lane's prompts;
    with ``parts`` > 1, the decode-only steps of each consecutive share of the log too (how a
    worker's steps and KV layout changed as it served)."""
    records = _records(path)
    lines = ["| decodes | with prompt tokens | beside the lane | steps | median ms | ms per prompt token "
             "| KV blocks a run |", "|---|---|---|---|---|---|---|"]
    for row in summarise(records, bucket):
        lines.append(f"| {row['decodes']} | {'yes' if row['prompt'] else 'no'} | "
                     f"{'yes' if row['beside_lane'] else 'no'} | {row['steps']} | {row['median_ms']} | "
                     f"{row.get('ms_per_prompt_token', '-')} | {row.get('blocks_per_run', '-')} |")
    if parts > 1:
        lines += ["", "| part of the log | decodes | decode-only steps | median ms | KV blocks a run |",
                  "|---|---|---|---|---|"]
        for index in range(parts):
            for row in summarise(records, bucket, (index, parts)):
                if not row["prompt"] and not row["beside_lane"]:
                    lines.append(f"| {index + 1} of {parts} | {row['decodes']} | {row['steps']} | "
                                 f"{row['median_ms']} | {row.get('blocks_per_run', '-')} |")
    steps = [r for r in records if r["kind"] == "step"]
    lane = [r for r in records if r["kind"] == "lane"]
    gaps = [r["gap_ms"] for r in steps if r["gap_ms"] is not None]
    if gaps:
        lines.append(f"\n{len(steps)} steps; between steps: median {statistics.median(gaps):.2f} ms, "
                     f"mean {statistics.fmean(gaps):.2f} ms")
    if lane:
        lines.append(f"lane: {len(lane)} prompts, median {statistics.median(r['ms'] for r in lane):.0f} ms, "
                     f"{statistics.median(r['ms'] / r['tokens'] for r in lane):.2f} ms a token")
    prompts = [r for r in records if r["kind"] == "prompt"]
    if prompts:
        lines += ["\n| prompts read in | prompts | tokens (median) | queue ms (median, mean) "
                  "| reading ms (median, mean) |", "|---|---|---|---|---|"]
        for steps in sorted({r["steps"] for r in prompts}):
            group = [r for r in prompts if r["steps"] == steps]
            queue, read = [r["queue_ms"] for r in group], [r["read_ms"] for r in group]
            where = "the lane (or another worker)" if steps == 0 else f"{steps} step{'s' if steps > 1 else ''}"
            lines.append(f"| {where} | {len(group)} | {statistics.median(r['tokens'] for r in group):.0f} | "
                         f"{statistics.median(queue):.0f}, {statistics.fmean(queue):.0f} | "
                         f"{statistics.median(read):.0f}, {statistics.fmean(read):.0f} |")
    return "\n".join(lines)
