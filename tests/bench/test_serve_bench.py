"""`tandem bench serve`'s metrics against a scripted SSE server with known timings."""

from __future__ import annotations

import asyncio
import json
import statistics
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

FIRST_S, GAP_S, NUM_TOKENS = 0.20, 0.12, 4  # the script: first token after 200 ms, then every 120 ms


RECEIVED: list[dict] = []  # every request body the scripted server got
SENT: dict[str, list[float]] = {}  # str(prompt) -> when each token event left the scripted server (perf_counter)


def sent_tpot_ms(prompt) -> float:
    """The gap the script really kept between first and last token, per token: a sleep can
    overrun on a busy machine, so the client's figure is compared with this, not with GAP_S."""
    stamps = SENT[str(prompt)]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


async def completions(request: Request):
    body = await request.json()
    RECEIVED.append(body)
    if body["prompt"] == "fail":
        return JSONResponse({"error": {"message": "scripted failure"}}, status_code=500)

    async def events():
        stamps = SENT.setdefault(str(body["prompt"]), [])
        stamps.clear()
        await asyncio.sleep(FIRST_S)
        for index in range(NUM_TOKENS):
            if index:
                await asyncio.sleep(GAP_S)
            stamps.append(time.perf_counter())
            yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{index}'}]})}\n\n"
        usage = {"prompt_tokens": 7, "completion_tokens": NUM_TOKENS, "prompt_tokens_details": {"cached_tokens": 3}}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def chat_completions(request: Request):
    body = await request.json()
    RECEIVED.append(body)

    async def events():
        await asyncio.sleep(FIRST_S)
        yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
        for index in range(NUM_TOKENS):
            if index:
                await asyncio.sleep(GAP_S)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': f't{index}'}}]})}\n\n"
        usage = {"prompt_tokens": 9, "completion_tokens": NUM_TOKENS}
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
              Route("/v1/chat/completions", chat_completions, methods=["POST"]),
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
    tolerance_ms = 80  # scheduling noise on a busy machine; the script's gaps are 120-200 ms
    assert summary["ttft_ms"]["mean"] == pytest.approx(FIRST_S * 1000, abs=tolerance_ms)
    assert summary["itl_ms"]["p50"] == pytest.approx(GAP_S * 1000, abs=tolerance_ms)
    assert summary["tpot_ms"]["mean"] == pytest.approx(sent_tpot_ms("hello"), abs=tolerance_ms / 2)
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
    # sent on schedule, not after earlier requests: sending one at a time would delay the last of
    # six by about five requests' time (~2.5 s); the bound leaves room for a busy host
    one_request_s = FIRST_S + (NUM_TOKENS - 1) * GAP_S
    assert all(r.ok for r in results) and max(r.send_delay_s for r in results) < 2 * one_request_s
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
    120 ms gap), and the table's ratios come from the goodputs measured."""
    from contextlib import nullcontext

    from bench.compare import Contender, compare, table

    honest = Contender("a", "scripted", [], lambda: nullcontext(scripted_server), "m")
    strict = Contender("b", "scripted, strict", [], lambda: nullcontext(scripted_server.replace("/v1", "/strict/v1")),
                       "m")
    requests = [BenchRequest("hello", NUM_TOKENS, -1)] * 2
    RECEIVED.clear()
    result = compare([honest, strict], [requests], [5.0], seed=0, slo_tpot_ms=None, slo_ttft_ms=None,
                     calibration=requests, say=lambda line: None, warm_up=[BenchRequest("warm", 2, -1)] * 3)
    assert sum(b.get("prompt") == "warm" for b in RECEIVED) == 3  # the honest one was warmed up (strict too)
    assert result.unloaded_step_ms == pytest.approx(GAP_S * 1000, abs=60)
    assert result.slo_tpot_ms == pytest.approx(3 * result.unloaded_step_ms)
    assert result.notes == {"a": [], "b": ["refuses ignore_eos: output lengths vary"]}
    a, b = result.runs["a"][5.0], result.runs["b"][5.0]
    assert a["completed"] == b["completed"] == 2 and a["goodput"] > 0 and b["goodput"] > 0
    rendered = table(result, "a")
    assert "| a | 5 | 2/2 |" in rendered and f"| {b['goodput']:.3f} | {b['goodput'] / a['goodput']:.2f}x |" in rendered


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "together"])
def test_compare_rounds_interleave_the_contenders_on_requests_of_their_own(scripted_server, alone):
    """--repeat: the contenders take turns rate by rate (the order reversed every other round),
    each round on its own requests; alone (the default), each is started and warmed up for its
    turn and stopped after it, so that the measured one is the only one up; together, both are
    up throughout. The table gives each figure's median and range and the ratio to the
    reference within each round."""
    from contextlib import contextmanager

    from bench.compare import Contender, compare_rounds, pooled_table, rounds_table

    live: list[str] = []
    starts: list[str] = []

    def launch(name: str, url: str):
        @contextmanager
        def started():
            live.append(name)
            starts.append(name)
            try:
                yield url
            finally:
                live.remove(name)
        return started

    a = Contender("a", "scripted", [], launch("a", scripted_server), "m")
    b = Contender("b", "scripted, strict", [], launch("b", scripted_server.replace("/v1", "/strict/v1")), "m")
    rounds = [[[BenchRequest(f"r{r}-x{i}", NUM_TOKENS, -1)] * 2 for i in range(2)] for r in range(2)]
    said, both_up = [], []

    def say(line: str) -> None:
        said.append(line)
        both_up.append(sorted(live))

    RECEIVED.clear()
    result = compare_rounds([a, b], rounds, [4.0, 8.0], seed=0, slo_tpot_ms=None, slo_ttft_ms=None,
                            calibration=[BenchRequest("hello", NUM_TOKENS, -1)] * 2, say=say,
                            warm_up=[BenchRequest("warm", 2, -1)], alone=alone)
    measured = [line.split(" @ ")[0].strip() for line in said if " req/s: SLOs met" in line]
    assert measured == ["a #1", "b #1", "a #1", "b #1", "b #2", "a #2", "b #2", "a #2"]
    up_when_measured = [up for up, line in zip(both_up, said) if " req/s: SLOs met" in line]
    if alone:
        assert up_when_measured == [[line.split()[0]] for line in measured]
        assert starts == [line.split()[0] for line in measured]  # a start per turn
    else:
        assert all(up == ["a", "b"] for up in up_when_measured) and starts == ["a", "b"]
    assert live == []
    # every start warmed up: a's warm-ups reach the script (b's strict path keeps no bodies)
    assert sum(body.get("prompt") == "warm" for body in RECEIVED) == starts.count("a")
    assert sum(line.startswith("unloaded decode step") for line in said) == 1
    prompts = [body["prompt"] for body in RECEIVED if str(body.get("prompt", "")).startswith("r")]  # a's (b keeps none)
    assert prompts == [f"r{r}-x{i}" for r in range(2) for i in range(2) for _ in range(2)]
    assert result.slo_tpot_ms == pytest.approx(3 * result.unloaded_step_ms)
    assert [len(result.rounds[name][rate]) for name in "ab" for rate in (4.0, 8.0)] == [2, 2, 2, 2]
    assert result.runs["a"][4.0] is result.rounds["a"][4.0][0]

    rendered = rounds_table(result, "a")
    a_ttft = [s["ttft_ms"]["p90"] for s in result.rounds["a"][8.0]]
    b_ttft = [s["ttft_ms"]["p90"] for s in result.rounds["b"][8.0]]
    ratios = sorted(y / x for x, y in zip(a_ttft, b_ttft))
    row = next(line for line in rendered.splitlines() if line.startswith("| b | 8 |"))
    assert f"| {statistics.median(b_ttft):.0f} ({min(b_ttft):.0f}-{max(b_ttft):.0f}) |" in row
    assert f"| {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[1]:.2f})x |" in row
    assert "| a | 4 | 2/2, 2/2 |" in rendered and "2 rounds" in rendered

    # pooled: every round's requests together, the percentile by nearest rank over all of them
    pooled = pooled_table(result, "a")
    a_all = sorted(v for s in result.rounds["a"][8.0] for v in s["samples_ms"]["ttft"])
    b_all = sorted(v for s in result.rounds["b"][8.0] for v in s["samples_ms"]["ttft"])
    assert len(b_all) == 4
    b_p90 = b_all[round(0.9 * 3)]  # of 4 samples, the 4th
    row = next(line for line in pooled.splitlines() if line.startswith("| b | 8 |"))
    assert row.startswith("| b | 8 | 4/4 | ") and f"| {b_p90:.0f} | {b_p90 / a_all[3]:.2f}x |" in row
    assert next(line for line in pooled.splitlines() if line.startswith("| a | 4 |")).count("| - |") == 4


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "together"])
def test_compare_capacities_take_turns_rate_by_rate(scripted_server, monkeypatch, alone):
    """--capacity --interleave: each contender with a search of its own, one rate at a time in
    turn (reversed every other turn), up only for its turn (alone) or both up throughout
    (together); a contender whose search is done sits out; a rate's requests are the same for
    everyone. The scripted servers serve alike, so the share within the SLOs is set per
    contender from each real measurement's rate."""
    from contextlib import contextmanager

    from bench import compare as compare_module
    from bench.compare import CapacityBounds, CapacitySearch, Contender, capacity_table, compare_capacities

    live: list[str] = []

    def launch(name: str):
        @contextmanager
        def started():
            live.append(name)
            try:
                yield scripted_server
            finally:
                live.remove(name)
        return started

    thresholds = {"a": 8.0, "b": 3.0}  # a passes every rate to the bound; b fails above 3
    measured, real = [], compare_module._measure

    def measure(contender, base_url, ignore_eos, rate, requests, *rest):
        summary = real(contender, base_url, ignore_eos, rate, requests, *rest)
        measured.append((contender.name, rate, sorted(live), requests))
        summary["slo_attainment"] = 1.0 if rate <= thresholds[contender.name] else 0.5
        return summary

    monkeypatch.setattr(compare_module, "_measure", measure)
    workloads = {}

    def workload(rate):
        return workloads.setdefault(rate, [BenchRequest(f"at {rate:.3f}", NUM_TOKENS, -1)] * 2)

    search = CapacitySearch(workload, CapacityBounds(start=4.0, min_rate=1.0, max_rate=8.0, step=1.5))
    contenders = [Contender(name, "scripted", [], launch(name), "m") for name in "ab"]
    result = compare_capacities(contenders, search, seed=0, slo_tpot_ms=None, slo_ttft_ms=None,
                                calibration=[BenchRequest("hello", NUM_TOKENS, -1)] * 2, say=lambda line: None,
                                alone=alone)
    turns = [(name, round(rate, 2)) for name, rate, _, _ in measured]
    assert turns == [("a", 4.0), ("b", 4.0), ("b", 2.0), ("a", 8.0), ("b", 2.83)]
    assert all(up == ([name] if alone else ["a", "b"]) for name, _, up, _ in measured) and live == []
    assert measured[0][3] is measured[1][3] == workloads[4.0]  # the same requests for both at 4 req/s
    assert (result.capacities["a"].rate, result.capacities["a"].ceiling) == (8.0, None)
    assert result.capacities["b"].rate == pytest.approx(8 ** 0.5) and result.capacities["b"].ceiling == 4.0
    assert sorted(result.runs["b"]) == pytest.approx([2.0, 8 ** 0.5, 4.0])
    assert all(s["completed"] == 2 for by_rate in result.runs.values() for s in by_rate.values())
    assert result.slo_tpot_ms == pytest.approx(3 * result.unloaded_step_ms)
    assert "| b | 2.83 | 4 | 4 (1/2), 2 (2/2), 2.83 (2/2) |" in capacity_table(result)


def test_compare_repeat_flag_is_for_a_sweep_or_a_capacity_search(monkeypatch):
    from bench import compare as compare_module
    from bench.compare import run_compare
    from cluster.cli import build_parser

    assert build_parser().parse_args(["bench", "compare"]).repeat == 1
    for extra in (["--repeat", "0"], ["--repeat", "2", "--traffic-mix", "a:1"]):
        with pytest.raises(SystemExit, match="--repeat"):
            run_compare(build_parser().parse_args(["bench", "compare", *extra]))
    with pytest.raises(SystemExit, match="--interleave is for --capacity"):
        run_compare(build_parser().parse_args(["bench", "compare", "--interleave"]))
    assert build_parser().parse_args(["bench", "compare", "--capacity", "--interleave"]).interleave

    class Started(Exception):
        pass

    def started(contenders, capacity, *args, **kwargs):
        raise Started(capacity, kwargs.get("alone"))

    monkeypatch.setattr(compare_module, "compare_capacities", started)
    monkeypatch.setattr("engine.model_info.load_model_info", lambda model: type("Info", (), {"model_dir": "/m"}))
    with pytest.raises(Started) as caught:
        run_compare(build_parser().parse_args(["bench", "compare", "--capacity", "--interleave", "--repeat", "3",
                                               "--contenders", "colocated"]))
    search, alone = caught.value.args
    assert search.sets == 3 and alone is True
    stride = compare_module.ROUND_SEED_STRIDE
    assert [seed for _, seed in search.rate_sets(1.0, 5)] == [5 + stride * i for i in range(3)]


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


def test_the_step_profile_of_a_run_is_the_difference_of_its_counters():
    from bench.compare import step_profile

    before = {"num_decode_steps": 10, "decode_steps_ms": 400.0, "decode_steps_seqs": 80, "num_prompt_steps": 2,
              "prompt_steps_ms": 300.0}
    after = {"num_decode_steps": 30, "decode_steps_ms": 1400.0, "decode_steps_seqs": 480, "num_prompt_steps": 6,
             "prompt_steps_ms": 900.0}
    assert step_profile(before, after) == pytest.approx(
        {"decode_steps": 20, "prompt_steps": 4, "decode_ms": 50.0, "decode_batch": 20.0, "prompt_ms": 150.0})
    assert step_profile(after, after)["decode_ms"] == 0.0  # no step in between
    assert step_profile(None, after) is None


def test_the_lane_profile_of_a_run_is_the_difference_of_its_counters():
    from bench.compare import lane_profile

    before = {"num_lane_prompts": 4, "num_lane_prompt_tokens": 1000, "lane_busy_ms": 2000,
              "num_lane_layers_helped": 7}
    after = {"num_lane_prompts": 10, "num_lane_prompt_tokens": 2500, "lane_busy_ms": 5000,
             "num_lane_layers_helped": 50}
    profile = lane_profile(before, after, duration_s=6.0)
    assert profile == pytest.approx({"prompts": 6, "tokens": 1500, "ms_per_prompt": 500.0, "busy_share": 0.5,
                                     "layers_helped": 43, "ms_per_token": 0.0, "slowdown": 0.0, "stream_ms_per_token_lane": 0.0,
                                     "stream_ms_per_token_steps": 0.0})  # no measures of the cost in these totals
    # the engine's measures at the end of the run: a token on the lane's thread at 0.9 ms, the steps beside
    # it 1.5x as long (the streams lose a third of their steps meanwhile), one in the steps at 0.4 ms
    measured = {**after, "lane_ms_per_token": 0.9, "lane_slowdown": 1.5, "step_ms_per_prompt_token": 0.4}
    costs = lane_profile(before, measured, duration_s=6.0)
    assert costs["stream_ms_per_token_lane"] == pytest.approx(0.9 / 3) and costs["stream_ms_per_token_steps"] == 0.4
    assert lane_profile(after, after, 6.0)["ms_per_prompt"] == 0.0  # nothing went through the lane
    assert lane_profile(None, after, 6.0) is None and lane_profile(before, after, 0.0) is None


def test_a_vllm_bench_serve_command_line_runs_unchanged(scripted_server, tmp_path, capsys):
    """`vllm bench serve`'s flags as a vLLM user writes them: base URL without /v1, endpoint,
    random dataset lengths, goodput SLOs, saved vLLM-shaped results."""
    from cluster.cli import main

    root = scripted_server.removesuffix("/v1")
    RECEIVED.clear()
    line = (f"--backend vllm --base-url {root} --endpoint /v1/completions --model m --dataset-name random "
            "--random-input-len 20 --random-output-len 4 --random-range-ratio 0.5 --random-prefix-len 5 "
            "--num-prompts 6 --request-rate 20 --burstiness 1.0 --seed 1 --ignore-eos --goodput ttft:1000 tpot:1000 "
            "--metric-percentiles 50,99.9 --percentile-metrics ttft,tpot,itl,e2el --temperature 0.5 --top-k 4 "
            "--save-result --result-dir " + str(tmp_path) + " --result-filename r.json --metadata site=here "
            "--tokenizer some/tokenizer --trust-remote-code --disable-tqdm")
    assert main(["bench", "serve", *line.split()]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["backend"] == "vllm"
    assert result["request_goodput"] > 0 and result["site"] == "here"
    assert result["total_output_tokens"] == 6 * NUM_TOKENS and result["total_input_tokens"] == 6 * 7
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99.9_ttft_ms", "p50_itl_ms", "std_tpot_ms", "mean_e2el_ms"):
        assert result[key] is not None and result[key] > 0, key
    assert FIRST_S * 1000 - 50 <= result["median_ttft_ms"] <= FIRST_S * 1000 + 2000  # the scripted first token
    assert "TTFT ms p50" in capsys.readouterr().out  # the percentiles asked for are printed
    bodies = [b for b in RECEIVED if b["prompt"] != "Hello"]  # less the ignore_eos probe
    assert len(bodies) == 6 and all(b["ignore_eos"] and b["temperature"] == 0.5 and b["top_k"] == 4 for b in bodies)
    lengths = [len(b["prompt"].split()) for b in bodies]
    assert all(5 + 10 <= n <= 5 + 30 for n in lengths) and len(set(lengths)) > 1  # prefix + 20 +- 50%
    assert len({" ".join(b["prompt"].split()[:5]) for b in bodies}) == 1  # the shared prefix
    assert {b["max_tokens"] for b in bodies} <= set(range(2, 7))


def test_openai_chat_backend_posts_messages_and_reads_deltas(scripted_server, tmp_path):
    from cluster.cli import main

    RECEIVED.clear()
    out = tmp_path / "chat.json"
    assert main(["bench", "serve", "--backend", "openai-chat", "--base-url", scripted_server, "--model", "m",
                 "--dataset-name", "random", "--random-input-len", "8", "--num-prompts", "2", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["server"]
    assert summary["completed"] == 2 and summary["total_output_tokens"] == 2 * NUM_TOKENS
    # the role-only event (sent at once) is not a token: the first token is the scripted one
    assert summary["ttft_ms"]["p50"] >= FIRST_S * 1000 - 50
    assert len(summary["samples_ms"]["itl"]) == 2 * (NUM_TOKENS - 1)
    assert all(gap >= GAP_S * 1000 - 50 for gap in summary["samples_ms"]["itl"])
    chats = [b for b in RECEIVED if "messages" in b]
    assert len(chats) == 2 and all(b["messages"][0]["role"] == "user" for b in chats)


@pytest.mark.parametrize("bad", [["ttft"], ["latency:5"], ["tpot:fast"]])
def test_goodput_pairs_are_checked(bad):
    from bench.serve_cli import parse_goodput

    assert parse_goodput(["ttft:500", "tpot:50", "e2el:9000"]) == {"ttft": 500.0, "tpot": 50.0, "e2el": 9000.0}
    with pytest.raises(ValueError, match="--goodput"):
        parse_goodput(bad)


def test_e2el_slo_counts_in_goodput():
    from bench.serve_bench import RequestResult

    fast = RequestResult(ok=True, send_delay_s=0, ttft_s=0.1, e2e_s=0.5, output_tokens=5)
    slow = RequestResult(ok=True, send_delay_s=0, ttft_s=0.1, e2e_s=3.0, output_tokens=5)
    summary = summarize([fast, slow], 1.0, slo_e2e_ms=1000, percentiles=[50])
    assert summary["slo_attainment"] == 0.5 and summary["e2e_ms"]["percentiles"] == {"50": 500.0}


def test_contenders_are_chosen_by_name_and_vllm_runs_as_a_module(tmp_path):
    from bench.compare import default_contenders

    named = default_contenders("m", "/weights", "bfloat16", [], ["colocated", "vllm", "disagg"],
                               vllm_python="/peers/bin/python")
    assert [c.name for c in named] == ["colocated", "vllm", "disagg"]
    vllm = named[1]
    assert vllm.command[:3] == ["/peers/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm.command[vllm.command.index("--model") + 1] == "/weights" and "bfloat16" in vllm.command
    assert vllm.env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and vllm.model == "bench"
    assert "--max-step-ms" not in named[0].command  # colocated with tandem's defaults
    budgets = default_contenders("m", "/weights", "float32", [256, 512], ["colocated"])
    assert [c.name for c in budgets] == ["colocated-256", "colocated-512"]
    assert budgets[0].command[-4:] == ["--max-num-batched-tokens", "256", "--max-step-ms", "off"]
    targets = default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_step_ms=["150", "off"])
    assert [c.name for c in targets] == ["colocated-step150", "colocated-stepoff"]
    assert targets[0].command[-2:] == ["--max-step-ms", "150"] and targets[1].command[-2:] == ["--max-step-ms", "off"]
    with pytest.raises(ValueError, match="--colocated-step-ms"):
        default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_step_ms=["0"])
    lanes = default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_tokens=["512", "off"])
    assert [c.name for c in lanes] == ["colocated-lane512", "colocated-laneoff"]
    assert lanes[0].command[-2:] == ["--prefill-lane-min-tokens", "512"]
    assert lanes[1].command[-2:] == ["--prefill-lane-min-tokens", "off"]
    with pytest.raises(ValueError, match="--colocated-lane-tokens"):
        default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_tokens=["-3"])
    waits = default_contenders("m", "/weights", "float32", [], ["colocated"],
                               colocated_lane_wait_ms=["0", "500", "off"])
    assert [c.name for c in waits] == ["colocated-wait0", "colocated-wait500", "colocated-waitoff"]
    assert [c.command[-2:] for c in waits] == [["--prefill-lane-max-wait-ms", w] for w in ("0", "500", "off")]
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError, match="--colocated-lane-wait-ms"):
            default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_wait_ms=[bad])
    policies = default_contenders("m", "/weights", "float32", [], ["colocated"],
                                  colocated_lane_policies=["first", "overflow"])
    assert [c.name for c in policies] == ["colocated-first", "colocated-overflow"]
    assert [c.command[-2:] for c in policies] == [["--prefill-lane-policy", p] for p in ("first", "overflow")]
    paces = default_contenders("m", "/weights", "float32", [], ["colocated"],
                               colocated_lane_policies=["pace", "pace:60", "cost", "cost:120"])
    assert [c.name for c in paces] == ["colocated-pace", "colocated-pace60", "colocated-cost", "colocated-cost120"]
    assert paces[0].command[-2:] == ["--prefill-lane-policy", "pace"]
    assert paces[1].command[-4:] == ["--prefill-lane-policy", "pace", "--prefill-lane-pace-ms", "60"]
    assert paces[2].command[-2:] == ["--prefill-lane-policy", "cost"]
    assert paces[3].command[-4:] == ["--prefill-lane-policy", "cost", "--prefill-lane-pace-ms", "120"]
    for bad in ("sometimes", "first:60", "pace:0", "pace:soon"):
        with pytest.raises(ValueError, match="--colocated-lane-policy"):
            default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_policies=[bad])
    helps = default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_help_ms=["80", "off"])
    assert [c.name for c in helps] == ["colocated-help80", "colocated-helpoff"]
    assert [c.command[-2:] for c in helps] == [["--prefill-lane-help-ms", v] for v in ("80", "off")]
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="--colocated-lane-help-ms"):
            default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_help_ms=[bad])
    ratios = default_contenders("m", "/weights", "float32", [], ["colocated"],
                                colocated_lane_ttft_ratios=["1.2", "off"])
    assert [c.name for c in ratios] == ["colocated-ttft1.2", "colocated-ttftoff"]
    assert [c.command[-2:] for c in ratios] == [["--prefill-lane-ttft-ratio", v] for v in ("1.2", "off")]
    for bad in ("0", "-1", "soon"):
        with pytest.raises(ValueError, match="--colocated-lane-ttft-ratio"):
            default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_lane_ttft_ratios=[bad])
    sets = default_contenders("m", "/weights", "float32", [], ["colocated"],
                              colocated_flag_sets=["--block-size 16", "--block-size 64 --max-step-ms 300"])
    assert [c.name for c in sets] == ["colocated-block-size16", "colocated-block-size64-max-step-ms300"]
    assert sets[0].command[-2:] == ["--block-size", "16"]
    assert sets[1].command[-4:] == ["--block-size", "64", "--max-step-ms", "300"]
    for bad in ("", "block-size 64"):
        with pytest.raises(ValueError, match="--colocated-flags"):
            default_contenders("m", "/weights", "float32", [], ["colocated"], colocated_flag_sets=[bad])
    with pytest.raises(ValueError, match="--vllm-python"):
        default_contenders("m", "/weights", "float32", [], ["vllm"])
    with pytest.raises(ValueError, match="unknown contenders"):
        default_contenders("m", "/weights", "float32", [], ["sglang"])


@pytest.mark.parametrize("threshold", [0.013, 0.3, 0.91, 1.0, 7.7, 50.0])
def test_capacity_search_brackets_the_threshold_within_ten_percent(threshold):
    from bench.compare import CapacityBounds, find_capacity

    found = find_capacity(lambda rate: 1.0 if rate <= threshold else 0.5, CapacityBounds(start=0.25))
    assert found.rate <= threshold < found.ceiling and found.ceiling / found.rate <= 1.1
    assert [rate for rate, _ in found.tried].count(found.rate) == 1  # no rate run twice
    assert all((share >= 0.9) == (rate <= threshold) for rate, share in found.tried)


def test_capacity_search_reports_its_bounds():
    from bench.compare import CapacityBounds, find_capacity

    never = find_capacity(lambda rate: 0.0, CapacityBounds(start=0.25, min_rate=0.05))
    assert never.rate is None and never.ceiling == 0.05 and [r for r, _ in never.tried] == [0.25, 0.125, 0.0625, 0.05]
    always = find_capacity(lambda rate: 1.0, CapacityBounds(start=1.0, max_rate=5.0))
    assert always.rate == 5.0 and always.ceiling is None and [r for r, _ in always.tried] == [1.0, 2.0, 4.0, 5.0]
    # 90% is enough; 89% is not
    edge = find_capacity(lambda rate: 0.9 if rate <= 2.0 else 0.89, CapacityBounds(start=1.0))
    assert 2.0 / 1.1 <= edge.rate <= 2.0 < edge.ceiling
    # a coarse bracket where each rate takes minutes: two rates, no bisection
    bracket = find_capacity(lambda rate: 1.0 if rate <= 0.1 else 0.5,
                            CapacityBounds(start=0.15, min_rate=0.075, max_rate=0.15, step=2.1))
    assert (bracket.rate, bracket.ceiling) == (0.075, 0.15) and [r for r, _ in bracket.tried] == [0.15, 0.075]
    with pytest.raises(ValueError):
        CapacityBounds(start=0.0)


def test_the_capacity_table_counts_requests_where_a_rounded_share_would_mislead():
    from bench.compare import _met

    assert _met({"slo_attainment": 43 / 48, "num_requests": 48}) == "43/48"  # 89.6%, not "90%"


def test_compare_capacity_against_scripted_servers(scripted_server):
    """The search wired through compare: a TPOT SLO above the script's 120 ms gap passes at
    every rate up to the bound; one below it fails down to the lowest rate; the table says so."""
    from contextlib import nullcontext

    from bench.compare import CapacityBounds, CapacitySearch, Contender, capacity_table, compare

    requests = [BenchRequest("hello", NUM_TOKENS, -1)] * 2
    served = Contender("a", "scripted", [], lambda: nullcontext(scripted_server), "m")
    asked = []

    def workload(rate):
        asked.append(rate)
        return requests

    search = CapacitySearch(workload, CapacityBounds(start=4.0, min_rate=2.0, max_rate=8.0))
    said = []
    easy = compare([served], [], [], seed=0, slo_tpot_ms=1000.0, slo_ttft_ms=None, calibration=requests,
                   say=said.append, capacity=search)
    assert easy.capacities["a"].rate == 8.0 and easy.capacities["a"].ceiling is None and asked == [4.0, 8.0]
    assert sorted(easy.runs["a"]) == [4.0, 8.0] and all(s["completed"] == 2 for s in easy.runs["a"].values())
    # each rate's line says how many requests met the SLOs as it ends (a search runs for an hour)
    assert [line.split(":")[0].split("@")[1].strip() for line in said if "SLOs met 2/2" in line] == ["4 req/s",
                                                                                                  "8 req/s"]
    said.clear()
    hard = compare([served], [], [], seed=0, slo_tpot_ms=GAP_S * 1000 / 4, slo_ttft_ms=None, calibration=requests,
                   say=said.append, capacity=search)
    assert sum("SLOs met 0/2" in line for line in said) == 2 and not any("SLOs met 2/2" in line for line in said)
    assert hard.capacities["a"].rate is None and hard.capacities["a"].ceiling == 2.0
    assert "| a | - | 2 | 4 (0/2), 2 (0/2) | - | - | - | - |" in capacity_table(hard)
    assert "| a | 8 | - | 4 (2/2), 8 (2/2) | 2/2 |" in capacity_table(easy)
    assert "at least 90% of the requests" in capacity_table(easy) and "at most 10% above it" in capacity_table(easy)


def test_compare_capacity_flags():
    from cluster.cli import build_parser

    args = build_parser().parse_args(["bench", "compare", "--capacity", "--capacity-start", "0.5"])
    assert args.capacity and args.capacity_start == 0.5
    assert (args.capacity_min, args.capacity_max, args.capacity_step) == (0.01, 64.0, 1.1)  # CapacityBounds'
    args = build_parser().parse_args(["bench", "compare", "--capacity", "--capacity-min", "0.075", "--capacity-max",
                                      "0.15", "--capacity-step", "2.1"])
    assert (args.capacity_min, args.capacity_max, args.capacity_step) == (0.075, 0.15, 2.1)
    assert not build_parser().parse_args(["bench", "compare"]).capacity


def test_capacity_workload_grows_with_the_rate_and_is_the_same_for_everyone():
    from bench.compare import capacity_workload
    from bench.datasets import RandomSpec

    spec = RandomSpec(20, 8, 0.0, 0)
    burst, steady = capacity_workload("random", 4, 0.0, 0, spec), capacity_workload("random", 4, 3.0, 0, spec)
    assert len(burst(10.0)) == 4 and len(steady(1.0)) == 4 and len(steady(10.0)) == 30
    assert steady(2.5) == capacity_workload("random", 4, 3.0, 0, spec)(2.5)  # another contender, the same requests
    assert burst(2.0) != burst(4.0)  # each rate its own prompts


def test_compare_json_keeps_everything_but_rounds_the_samples():
    """compare.json: every field as json.dumps gives it, except samples_ms rounded to 10 us;
    lists of numbers on one line (three rounds' ITLs were 1.7 MB one number per line)."""
    from bench.compare import compact_json

    data = {"runs": {"a": {"0.5": {"samples_ms": {"itl": [19.308382000417623, 1e-05, 1234.5678], "ttft": []},
                                   "ttft_ms": {"p90": 2082.019448000050, "percentiles": {}}}}},
            "capacities": {"a": {"rate": 0.7, "tried": [[0.7, 0.9375], [1.4, -0.5]]}}, "rates": [0.5, 2],
            "notes": {"a": ["refuses [1, 2]", "a list in text [1,2]"]}, "nothing": None}
    text = compact_json(data)
    loaded = json.loads(text)
    assert loaded["runs"]["a"]["0.5"]["samples_ms"] == {"itl": [19.31, 0.0, 1234.57], "ttft": []}
    expected = json.loads(json.dumps(data))
    expected["runs"]["a"]["0.5"]["samples_ms"] = loaded["runs"]["a"]["0.5"]["samples_ms"]
    assert loaded == expected  # the rest untouched, the p90 to the last digit
    assert '"itl": [19.31, 0.0, 1234.57]' in text and "[0.7, 0.9375]" in text and '"rates": [0.5, 2]' in text
    assert json.dumps(data["notes"]["a"][1]) in text  # text that looks like a list stays as it was


def test_a_launched_server_started_again_waits_for_its_own_ready_line():
    """``--turns alone`` starts each contender again for every turn: the second start must wait
    for the new process's ready line, not return on the first process's, still in the log."""
    import sys

    from bench.launch import LaunchedServe

    launched = LaunchedServe([], ready_timeout_s=60)
    launched.command = [sys.executable, "-c", "import os, sys, time; time.sleep(0.5); "
                        "print(f'ready: http pid={os.getpid()}', file=sys.stderr, flush=True); time.sleep(60)"]
    pids = []
    for _ in range(2):
        launched.start()
        try:
            pids.append(launched.process.pid)
            ready = [line for line in launched.log if "ready: http" in line]
            assert ready == [f"ready: http pid={launched.process.pid}\n"]
        finally:
            launched.stop()
    assert pids[0] != pids[1] and launched.process.poll() is not None


@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "one-after-another"])
def test_a_capacity_search_with_sets_passes_a_rate_on_all_its_sets_together(scripted_server, monkeypatch,
                                                                            interleave):
    """--capacity --repeat 2: each rate runs two sets of requests (their own prompts and
    arrivals, the same for every contender) and passes on their requests together: a set of
    2/2 and one of 1/2 make 3/4, under 90%, where the first set alone would pass."""
    from contextlib import nullcontext

    from bench import compare as compare_module
    from bench.compare import (
        ROUND_SEED_STRIDE,
        CapacityBounds,
        CapacitySearch,
        Contender,
        capacity_table,
        compare,
        compare_capacities,
    )

    measured, real = [], compare_module._measure

    def measure(contender, base_url, ignore_eos, rate, requests, seed, *rest):
        summary = real(contender, base_url, ignore_eos, rate, requests, seed, *rest)
        index = len([m for m in measured if m[:2] == (contender.name, rate)])
        measured.append((contender.name, rate, requests[0].prompt, seed))
        # a passes every set below 6 req/s; b's second set at 4 req/s fails half its requests
        failing = rate > 6 or (contender.name == "b" and rate == 4.0 and index == 1)
        summary["slo_attainment"] = 0.5 if failing else 1.0
        return summary

    monkeypatch.setattr(compare_module, "_measure", measure)

    def workload(rate, index=0):
        return [BenchRequest(f"at {rate:.3f} set {index}", NUM_TOKENS, -1)] * 2

    search = CapacitySearch(workload, CapacityBounds(start=4.0, min_rate=2.0, max_rate=8.0, step=2.0), sets=2)
    contenders = [Contender(name, "scripted", [], lambda: nullcontext(scripted_server), "m") for name in "ab"]
    run = compare_capacities if interleave else compare
    extra = {} if interleave else {"workloads": [], "rates": []}
    result = run(contenders, capacity=search, seed=7, slo_tpot_ms=None, slo_ttft_ms=None,
                 calibration=[BenchRequest("hello", NUM_TOKENS, -1)] * 2, say=lambda line: None, **extra)
    for name in "ab":
        at_four = [(prompt, seed) for who, rate, prompt, seed in measured if (who, rate) == (name, 4.0)]
        assert at_four == [("at 4.000 set 0", 7), ("at 4.000 set 1", 7 + ROUND_SEED_STRIDE)]
    assert (result.capacities["a"].rate, result.capacities["a"].ceiling) == (4.0, 8.0)
    assert (result.capacities["b"].rate, result.capacities["b"].ceiling) == (2.0, 4.0)  # 3/4 at 4 fails
    assert [len(result.rounds["b"][rate]) for rate in (2.0, 4.0)] == [2, 2]
    rendered = capacity_table(result)
    assert "| b | 2 | 4 | 4 (3/4), 2 (4/4) | 4/4 |" in rendered
    assert "| a | 4 | 8 | 4 (4/4), 8 (2/4) | 4/4 |" in rendered


def test_a_stray_ray_worker_is_named_before_a_benchmark_measures():
    from bench.compare import stray_ray_workers
    from tests.cluster.test_reap import titled

    stray, other = titled("ray::WorkerActor", 600), titled("sleep", 600)
    try:
        assert stray.pid in stray_ray_workers() and other.pid not in stray_ray_workers()
        stray.kill()
        stray.wait()
        assert stray.pid not in stray_ray_workers()
    finally:
        for process in (stray, other):
            process.kill()
            process.wait()
