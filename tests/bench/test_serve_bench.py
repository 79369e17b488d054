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


@pytest.fixture(scope="module")
def scripted_server():
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])]),
                                           host="127.0.0.1", port=port, log_level="warning"))
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
