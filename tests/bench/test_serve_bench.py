"""`tandem bench serve`'s metrics against a scripted SSE server with known timings."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from bench.datasets import BenchRequest, make_dataset
from bench.launch import free_port
from bench.serve_bench import LoadConfig, run_load, summarize
from tests.workers import wait_until

FIRST_S, GAP_S, NUM_TOKENS = 0.30, 0.20, 4  # the script: first token after 300 ms, then every 200 ms


async def completions(request: Request):
    body = await request.json()
    if body["prompt"] == "fail":
        return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)

    async def events():
        await asyncio.sleep(FIRST_S)
        for index in range(NUM_TOKENS):
            if index:
                await asyncio.sleep(GAP_S)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{index}'}]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": NUM_TOKENS, "prompt_tokens_details": {"cached_tokens": 3}}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def strict_completions(request: Request):
    """A server like `transformers serve`: refuses fields it does not know, sends no usage."""
    body = await request.json()
    if "ignore_eos" in body:
        return JSONResponse({"detail": "Unexpected fields in the request: {'ignore_eos'}"}, status_code=422)
    if not body.get("stream"):
        return JSONResponse({"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})

    async def events():
        await asyncio.sleep(FIRST_S)
        for index in range(NUM_TOKENS - 1):  # stops at its EOS one token early
            if index:
                await asyncio.sleep(GAP_S)
            finish = "stop" if index == NUM_TOKENS - 2 else None
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{index}', 'finish_reason': finish}]})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def scripted_server():
    port = free_port()
    routes = [Route("/v1/completions", completions, methods=["POST"]),
              Route("/strict/v1/completions", strict_completions, methods=["POST"])]
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the scripted server")
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)


def test_metrics_equal_the_scripted_timings(scripted_server):
    requests = [BenchRequest("hello", NUM_TOKENS, -1), BenchRequest("fail", NUM_TOKENS, -1)]
    results, duration = asyncio.run(run_load(LoadConfig(scripted_server, "m"), requests))
    summary = summarize(results, duration, slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert (summary["completed"], summary["failed"]) == (1, 1) and "HTTP 500" in summary["errors"][0]
    tolerance_ms = 80  # scheduling noise on a busy machine; the script's gaps are 200-300 ms
    assert summary["ttft_ms"]["mean"] == pytest.approx(FIRST_S * 1000, abs=tolerance_ms)
    assert summary["itl_ms"]["p50"] == pytest.approx(GAP_S * 1000, abs=tolerance_ms)
    assert summary["tpot_ms"]["mean"] == pytest.approx(GAP_S * 1000, abs=tolerance_ms)
    (ok,) = [r for r in results if r.ok]
    assert len(ok.itl_s) == NUM_TOKENS - 1 and ok.tpot_s == pytest.approx((ok.e2e_s - ok.ttft_s) / (NUM_TOKENS - 1))
    assert summary["goodput"] == pytest.approx(1 / duration)  # the failed request is a miss
    assert summary["slo_attainment"] == 0.5
    assert summary["prefix_hit_rate"] == pytest.approx(3 / 7)
    strict = summarize(results, duration, slo_ttft_ms=FIRST_S * 1000 / 2)
    assert strict["goodput"] == 0.0  # nobody meets a TTFT SLO of half the scripted first token


def test_poisson_schedule_spreads_requests(scripted_server):
    requests = [BenchRequest("hello", NUM_TOKENS, -1)] * 6
    start = time.perf_counter()
    results, _ = asyncio.run(run_load(LoadConfig(scripted_server, "m", request_rate=10.0, seed=3), requests))
    assert all(r.ok for r in results) and max(r.send_delay_s for r in results) < 0.5
    assert time.perf_counter() - start > FIRST_S + (NUM_TOKENS - 1) * GAP_S


def test_shared_prefix_dataset_is_deterministic_and_grouped():
    first, again = make_dataset("shared-prefix", 12, seed=1), make_dataset("shared-prefix", 12, seed=1)
    assert first == again and first != make_dataset("shared-prefix", 12, seed=2)
    by_group: dict[int, set[str]] = {}
    for request in first:
        by_group.setdefault(request.group, set()).add(request.prompt.split("\nUser:")[0])
    assert len(by_group) == 4 and all(len(systems) == 1 for systems in by_group.values())


def test_cli_runs_against_a_server_and_writes_json(scripted_server, tmp_path, capsys):
    from cluster.cli import main

    out = tmp_path / "bench.json"
    assert main(["bench", "serve", "--base-url", scripted_server, "--model", "m", "--dataset", "random",
                 "--num-prompts", "3", "--request-rate", "20", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["server"]
    assert summary["completed"] == 3 and summary["ttft_ms"]["p50"] > 0
    assert "TTFT ms mean/p50/p90/p99" in capsys.readouterr().out


def test_ignore_eos_and_missing_usage_are_detected_and_reported(scripted_server):
    from bench.serve_bench import probe_ignore_eos, render

    strict = scripted_server.replace("/v1", "/strict/v1")
    assert probe_ignore_eos(scripted_server, "m") is True
    assert probe_ignore_eos(strict, "m") is False
    requests = [BenchRequest("hello", NUM_TOKENS, -1)] * 2
    results, duration = asyncio.run(run_load(LoadConfig(strict, "m", ignore_eos=False), requests))
    summary = summarize(results, duration)
    assert summary["completed"] == 2 and not summary["usage_reported"]
    assert [r.output_tokens for r in results] == [NUM_TOKENS - 1] * 2  # counted from the stream
    assert [r.finish_reason for r in results] == ["stop", "stop"]
    assert not summary["ignore_eos_honored"] and summary["num_stopped_short"] == 2
    text = render("strict", summary)
    assert "ignore_eos not honoured: 2 requests" in text and "no usage in the stream" in text
    # the honest server: every request ran to its max_tokens
    results, duration = asyncio.run(run_load(LoadConfig(scripted_server, "m"), requests))
    honest = summarize(results, duration)
    assert honest["ignore_eos_honored"] and honest["usage_reported"] and results[0].finish_reason == ""


def test_long_prompt_and_decode_heavy_datasets():
    long, heavy = make_dataset("long-prompt", 8, seed=5), make_dataset("decode-heavy", 8, seed=5)
    assert long == make_dataset("long-prompt", 8, seed=5)
    assert all(950 <= len(r.prompt.split()) <= 1050 and 60 <= r.max_tokens <= 68 for r in long)
    assert all(28 <= len(r.prompt.split()) <= 36 and 230 <= r.max_tokens <= 282 for r in heavy)
    assert len({r.prompt.split()[0:8].__str__() for r in long}) == 8  # no shared prefixes


def test_sweep_writes_plots_and_per_rate_json(scripted_server, tmp_path):
    from cluster.cli import main

    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    assert main(["bench", "serve", "--base-url", scripted_server, "--model", "m", "--dataset", "random",
                 "--num-prompts", "2", "--sweep", "5,10", "--out", str(out), "--plot-dir", str(plots)]) == 0
    by_rate = json.loads(out.read_text())
    assert sorted(by_rate) == ["10.0", "5.0"] and all(s["completed"] == 2 for s in by_rate.values())
    for name in ("latency_cdfs.png", "sweep.png"):
        data = (plots / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_compare_calibrates_the_slo_and_ranks_servers(scripted_server):
    """Two scripted contenders: the TPOT SLO is 3x the measured unloaded step (the script's
    200 ms gap), and the table's ratios come from the goodputs measured."""
    from contextlib import nullcontext

    from bench.compare import Contender, compare, table

    honest = Contender("a", "scripted", [], lambda: nullcontext(scripted_server), "m")
    strict = Contender("b", "scripted, strict", [], lambda: nullcontext(scripted_server.replace("/v1", "/strict/v1")),
                       "m")
    requests = [BenchRequest("hello", NUM_TOKENS, -1)] * 2
    result = compare([honest, strict], [requests], [5.0], seed=0, slo_tpot_ms=None, slo_ttft_ms=None,
                     calibration=requests,
                     say=lambda line: None)
    assert result.unloaded_step_ms == pytest.approx(GAP_S * 1000, abs=60)
    assert result.slo_tpot_ms == pytest.approx(3 * result.unloaded_step_ms)
    assert result.notes == {"a": [], "b": ["refuses ignore_eos: output lengths vary"]}
    a, b = result.runs["a"][5.0], result.runs["b"][5.0]
    assert a["completed"] == b["completed"] == 2 and a["goodput"] > 0 and b["goodput"] > 0
    rendered = table(result, "a")
    assert "| a | 5 |" in rendered and f"{a['goodput'] / b['goodput']:.2f}x" in rendered


def test_transformers_serve_contender_runs_the_workload(smollm_dir):
    """The real `transformers serve --continuous-batching` as bench compare starts it: it
    refuses ignore_eos (detected) and serves the same weights tandem converted."""
    from bench.compare import transformers_contender
    from bench.serve_bench import probe_ignore_eos

    contender = transformers_contender(str(smollm_dir), "float32", threads=1)
    with contender.launch() as base_url:
        assert probe_ignore_eos(base_url, contender.model) is False
        requests = make_dataset("random", 2, seed=0)
        results, duration = asyncio.run(run_load(LoadConfig(base_url, contender.model, ignore_eos=False),
                                                 [BenchRequest(r.prompt[:200], 8, -1) for r in requests]))
    summary = summarize(results, duration)
    assert summary["completed"] == 2, summary["errors"]
    assert summary["usage_reported"] and all(0 < r.output_tokens <= 8 for r in results)


def test_stage_means_come_from_the_metrics_delta():
    from bench.compare import stage_means_ms

    before = {"prefill": (2.0, 4.0), "decode": (10.0, 4.0)}
    after = {"prefill": (5.0, 6.0), "decode": (10.0, 4.0), "kv_transfer": (0.03, 2.0)}
    assert stage_means_ms(before, after) == pytest.approx({"prefill": 1500.0, "kv_transfer": 15.0})
    assert stage_means_ms(None, after)["prefill"] == pytest.approx(5000 / 6)
    assert stage_means_ms(before, None) is None
