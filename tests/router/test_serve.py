"""A live `tandem serve` (real Ray actors, real gRPC, real HTTP) in both modes, driven by the
official `openai` package and raw HTTP. Outputs are compared with `LLM.generate` / `LLM.chat`
under DESIGN.md's token-equality rule."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import grpc
import httpx
import openai
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import TandemClient, TandemError
from engine import SamplingParams
from tests.reference import EqualityStats, assert_same_tokens_as_text
from tests.router.conftest import FAULT_SEED, assert_cut_short, fault_env, start_server
from tests.workers import wait_until

QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about the sea.", "What is two plus two?", "Who wrote Hamlet?"]


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=server.api_key or "unused", max_retries=0,
                         timeout=120)


def chat_reference(llm, question: str, max_tokens: int):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    return llm.chat([{"role": "user", "content": question}], params)[0]


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_openai_client_chat_and_completions_equal_llm(mode, request, llm):
    server = request.getfixturevalue(f"{mode}_server")
    api = client(server)
    worker = "prefill" if mode == "disagg" else "decode"
    computed_before = server.metric("num_prompt_tokens_computed", worker)
    decode_computed_before = server.metric("num_prompt_tokens_computed", "decode")
    stats = EqualityStats()

    # chat, not streamed, with logprobs: tokens compared one by one
    for question in QUESTIONS[:2]:
        reference = chat_reference(llm, f"[{mode}] {question}", 24)
        answer = api.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=24, logprobs=True,
                                             top_logprobs=2, messages=[{"role": "user", "content": f"[{mode}] {question}"}])
        tokens = [entry.token for entry in answer.choices[0].logprobs.content]
        assert_same_tokens_as_text(tokens, reference.outputs[0], stats, label=question)
        assert answer.usage.completion_tokens == len(tokens) == len(reference.outputs[0].token_ids)
        assert answer.usage.prompt_tokens == len(reference.prompt_token_ids)
        assert answer.choices[0].finish_reason == reference.outputs[0].finish_reason
        assert answer.choices[0].message.content == reference.outputs[0].text

    # the same, streamed: the first event carries the first token; the text is the same
    reference = chat_reference(llm, f"[{mode}] {QUESTIONS[2]}", 24)
    events = list(api.chat.completions.create(
        model="smollm2-135m-instruct", temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": f"[{mode}] {QUESTIONS[2]}"}]))
    assert events[0].choices[0].delta.role == "assistant" and events[0].choices[0].delta.content
    assert "".join(e.choices[0].delta.content or "" for e in events if e.choices) == reference.outputs[0].text
    assert events[-1].usage.completion_tokens == len(reference.outputs[0].token_ids)

    # completions with a list of prompts
    prompts = [f"[{mode}] The sea is", f"[{mode}] Once upon a time"]
    completion = api.completions.create(model="smollm2-135m-instruct", prompt=prompts, max_tokens=12, temperature=0,
                                        logprobs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
    for choice, ref in zip(sorted(completion.choices, key=lambda c: c.index), llm.generate(prompts, greedy)):
        assert_same_tokens_as_text(choice.logprobs.tokens, ref.outputs[0], stats, label=choice.text)
    assert completion.usage.prompt_tokens == sum(len(llm.get_tokenizer().encode(p)) for p in prompts)
    print(f"token-equality: {stats.compared} sequences, near-tie rule fired {stats.near_ties} times")
    assert stats.near_ties <= 1

    # the workers did the work: the prompt was computed where the mode says
    wait_until(lambda: server.metric("num_prompt_tokens_computed", worker) > computed_before, what="worker Stats")
    if mode == "disagg":
        assert server.metric("num_prompt_tokens_computed", "decode") == decode_computed_before
        assert server.metric("kv_bytes_received", "decode") > 0


def test_error_cases_over_raw_http(disagg_server, colocated_server):
    url = disagg_server.base_url
    post = lambda path, body, **kw: httpx.post(f"{url}{path}", json=body, timeout=30, **kw)  # noqa: E731
    cases = [
        ({"model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": "smollm2-135m-instruct", "prompt": "x", "colour": "blue"}, 400, "unknown field 'colour'"),
        ({"model": "smollm2-135m-instruct", "prompt": "x", "logit_bias": {"1": 5}}, 400, "'logit_bias' is not supported"),
        ({"model": "smollm2-135m-instruct", "prompt": "x", "n": 99}, 400, "at most"),
        ({"model": "smollm2-135m-instruct", "prompt": "x", "max_tokens": 5000}, 400, "maximum context length is 1024"),
        ({"model": "smollm2-135m-instruct", "prompt": "word " * 1100}, 400, "maximum context length is 1024"),
        ({"model": "no-such-model", "prompt": "x"}, 404, "does not exist"),
    ]
    for body, status, message in cases:
        response = post("/v1/completions", body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert message in error["message"] and error["code"] == status and error["type"], error
    chat_tools = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "tools": []}
    assert "'tools' is not supported" in post("/v1/chat/completions", chat_tools).json()["error"]["message"]
    huge = post("/v1/completions", {"model": "smollm2-135m-instruct", "prompt": "x" * (17 << 20)})
    assert huge.status_code == 413 and "larger than" in huge.json()["error"]["message"]
    # a key is required on the server started with --api-key (but not for health/ready/metrics)
    keyed = colocated_server.base_url
    assert httpx.get(f"{keyed}/v1/models", timeout=10).status_code == 401
    assert httpx.get(f"{keyed}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(f"{keyed}/health", timeout=10).status_code == 200
    models = httpx.get(f"{keyed}/v1/models", headers=colocated_server.headers, timeout=10).json()
    assert models["data"][0]["id"] == "smollm2-135m-instruct" and models["data"][0]["max_model_len"] == 1024
    # X-Request-Id is returned as given
    response = post("/v1/completions", {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 2},
                    headers={"X-Request-Id": "trace-me-123"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-me-123"
    # tokenize / detokenize / version / ready
    tokens = post("/tokenize", {"model": "smollm2-135m-instruct", "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert post("/detokenize", {"model": "smollm2-135m-instruct", "tokens": tokens["tokens"]}).json()["prompt"] == \
        "Hello world"
    chat_count = post("/tokenize", {"messages": [{"role": "user", "content": "Hello"}]}).json()["count"]
    assert chat_count > tokens["count"]  # the chat template's tokens are counted
    assert httpx.get(f"{url}/version", timeout=10).json()["version"]
    assert httpx.get(f"{url}/ready", timeout=10).json() == {"ready": True}
    assert httpx.get(f"{url}/openapi.json", timeout=10).status_code == 200
    # and it still serves correctly afterwards
    answer = client(disagg_server).completions.create(model="smollm2-135m-instruct", prompt="The capital of France is",
                                                      max_tokens=3, temperature=0)
    assert answer.choices[0].text and answer.usage.completion_tokens == 3


def test_admission_limit_gives_429_with_retry_after(colocated_server):
    """--max-queue 3 on this server: a fourth request while three stream is refused."""
    url, headers = colocated_server.base_url, colocated_server.headers
    body = {"model": "smollm2-135m-instruct", "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=headers) as http:
        streams = [http.stream("POST", f"{url}/v1/completions", json=body) for _ in range(3)]
        lines = [s.__enter__().iter_lines() for s in streams]  # kept: a dropped iterator closes its stream
        for stream_lines in lines:
            next(stream_lines)  # each is in flight
        refused = http.post(f"{url}/v1/completions", json={**body, "stream": False, "max_tokens": 2})
        for stream in streams:
            stream.__exit__(None, None, None)
    assert refused.status_code == 429 and refused.headers["retry-after"]
    assert "max-queue" in refused.json()["error"]["message"]


def test_client_disconnect_cuts_the_request_short_everywhere(disagg_server):
    server = disagg_server
    decoded_before = server.metric("num_generation_tokens", "decode")
    body = {"model": "smollm2-135m-instruct", "prompt": "Tell me a very long story.", "max_tokens": 900,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]  # a few events, then the client goes away
    assert any(line.startswith("data: ") for line in received)
    assert_cut_short(server, decoded_before, "the disconnect")


def test_client_disconnect_cuts_a_whole_answer_short_everywhere(disagg_server):
    """Not streamed: nothing is written before the end, so only the router's watch on the
    connection notices the client leave (a 900-token answer takes 20-30 s here)."""
    server = disagg_server
    decoded_before = server.metric("num_generation_tokens", "decode")
    body = {"model": "smollm2-135m-instruct", "prompt": "Tell me a very long story.", "max_tokens": 900,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=2.0)
    assert_cut_short(server, decoded_before, "the disconnect")


def test_fifty_concurrent_streams(disagg_server, llm):
    references = {q: chat_reference(llm, q, 8).outputs[0].text for q in QUESTIONS}
    api = openai.AsyncOpenAI(base_url=f"{disagg_server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(question: str) -> str:
        stream = await api.chat.completions.create(model="smollm2-135m-instruct", temperature=0, max_tokens=8,
                                                   stream=True, messages=[{"role": "user", "content": question}])
        return "".join([e.choices[0].delta.content or "" async for e in stream if e.choices])

    async def run_all():
        questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(50)]
        return questions, await asyncio.gather(*(one(q) for q in questions))

    questions, answers = asyncio.run(run_all())
    wrong = [(q, a) for q, a in zip(questions, answers) if a != references[q]]
    assert not wrong, f"{len(wrong)} of 50 differ, e.g. {wrong[0]}"
    wait_until(lambda: disagg_server.metric("max_num_running", "decode") > 1, what="worker Stats")
    assert disagg_server.metric("max_num_running", "decode") >= 8  # they really ran together


def test_sigterm_drains_and_leaves_no_process(smollm_dir):
    server = start_server(smollm_dir, "colocated", "--drain-timeout", "2", wait_for="listening on")
    try:
        # up but not ready while the workers load: probes can tell
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
        assert httpx.get(f"{server.base_url}/ready", timeout=10).status_code == 503
        with grpc.insecure_channel(server.grpc_target) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: any("ready: http" in line for line in server.log), timeout_s=300, what="ready")
        children = server.descendants()
        assert children, "tandem serve started no processes?"
        body = {"model": "smollm2-135m-instruct", "prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.base_url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            server.process.send_signal(signal.SIGTERM)
            wait_until(lambda: any("draining" in line for line in server.log), what="the drain to begin")
            late = httpx.post(f"{server.base_url}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert late.status_code == 503
            assert httpx.get(f"{server.base_url}/ready", timeout=10).status_code == 503
            with grpc.insecure_channel(server.grpc_target) as channel:  # the gRPC API drains too
                health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with TandemClient(server.grpc_target, max_retries=0) as tandem, pytest.raises(TandemError) as info:
                tandem.complete("x")
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["choices"][0]["finish_reason"] in ("abort", "length")
        assert server.process.wait(60) == 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                                                  for p in children):
            time.sleep(0.2)
        alive = [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"left behind: {[p.name() for p in alive]}"
    finally:
        server.stop()


def test_n_seed_and_echo_with_prompt_logprobs(disagg_server, llm):
    api = client(disagg_server)
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    answer = api.completions.create(model="smollm2-135m-instruct", prompt="[n] The weather today", n=2,
                                    temperature=0.8, seed=7, max_tokens=6, extra_body={"ignore_eos": True})
    reference = llm.generate("[n] The weather today", params)[0]
    assert [c.text for c in sorted(answer.choices, key=lambda c: c.index)] == [o.text for o in reference.outputs]
    assert answer.usage.completion_tokens == 12

    prompt = "[echo] Paris is"
    echoed = api.completions.create(model="smollm2-135m-instruct", prompt=prompt, max_tokens=3, temperature=0,
                                    echo=True, logprobs=1)
    choice = echoed.choices[0]
    num_prompt = len(llm.get_tokenizer().encode(prompt))
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None and all(
        lp is not None and lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    offline = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=1))[0]
    for position in range(1, num_prompt):  # the prompt's own logprobs, from the workers
        expected = offline.prompt_logprobs[position][offline.prompt_token_ids[position]].logprob
        assert choice.logprobs.token_logprobs[position] == pytest.approx(expected, abs=1e-4)


def test_cached_tokens_and_stop_strings(disagg_server, llm):
    api = client(disagg_server)
    messages = [{"role": "system", "content": "You are a helpful assistant who answers in one short sentence. " * 3},
                {"role": "user", "content": "[cache] What colour is the sky?"}]
    first = api.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=4, temperature=0)
    second = api.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 48
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // 16 * 16 - 16
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens

    stopped = api.completions.create(model="smollm2-135m-instruct", prompt="[stop] One, two, three, four", max_tokens=20,
                                     temperature=0, stop=[","])
    reference = llm.generate("[stop] One, two, three, four", SamplingParams(temperature=0.0, max_tokens=20, stop=[","]))
    assert stopped.choices[0].text == reference[0].outputs[0].text and "," not in stopped.choices[0].text
    assert stopped.choices[0].finish_reason == reference[0].outputs[0].finish_reason


def test_a_worker_that_cannot_start_is_a_clear_error(smollm_dir):
    with pytest.raises(RuntimeError) as info:  # the engine refuses: 2 blocks cannot hold 1024 tokens
        start_server(smollm_dir, "colocated", "--num-kv-blocks", "2", ready_timeout_s=180)
    message = str(info.value)
    assert "exited with 1" in message and "decode worker failed to start" in message
    assert "max_model_len" in message and "stopped" in message


def test_device_cuda_without_a_gpu_is_refused_before_any_worker_starts(smollm_dir, disagg_server):
    with pytest.raises(RuntimeError) as info:
        start_server(smollm_dir, "colocated", "--device", "cuda", ready_timeout_s=180)
    message = str(info.value)
    assert "exited with 2" in message and "--device cuda, but the Ray cluster has no GPU" in message
    assert "starting" not in message  # no worker was started
    # the default, auto, puts every worker on the CPU here, and says so
    assert "workers: prefill on the CPU, decode on the CPU" in "\n".join(disagg_server.log)


def prometheus_sum(text: str, name: str, label: str = "") -> float:
    """Sum of the samples of ``name`` (optionally only those whose labels contain ``label``)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_router_metrics_count_every_request_and_token(disagg_server):
    metrics = lambda: httpx.get(f"{disagg_server.base_url}/metrics", timeout=10).text  # noqa: E731
    names = ("tandem:request_success_total", "tandem:prompt_tokens_total", "tandem:generation_tokens_total",
             "tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count",
             "tandem:inter_token_latency_seconds_count")
    before_text = metrics()
    before = {name: prometheus_sum(before_text, name) for name in names}
    remote_before = prometheus_sum(before_text, "tandem:routing_decisions_total", 'decision="remote"')
    api = client(disagg_server)
    usages = [api.completions.create(model="smollm2-135m-instruct", prompt=f"[metrics {i}] Hello", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True}).usage for i in range(3)]
    streamed = list(api.completions.create(model="smollm2-135m-instruct", prompt="[metrics] streamed", max_tokens=4,
                                           temperature=0, stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True}))
    usages.append(streamed[-1].usage)
    after_text = metrics()
    delta = {name: prometheus_sum(after_text, name) - before[name] for name in names}
    assert delta["tandem:request_success_total"] == 4
    assert delta["tandem:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert delta["tandem:generation_tokens_total"] == sum(u.completion_tokens for u in usages) == 19
    assert delta["tandem:time_to_first_token_seconds_count"] == 4
    assert delta["tandem:e2e_request_latency_seconds_count"] == 4
    assert delta["tandem:inter_token_latency_seconds_count"] == 19 - 4  # every token after each first one
    assert prometheus_sum(after_text, "tandem:routing_decisions_total", 'decision="remote"') - remote_before == 4


def test_cluster_metrics_from_worker_stats(disagg_server):
    text = lambda: httpx.get(f"{disagg_server.base_url}/metrics", timeout=10).text  # noqa: E731
    time.sleep(1.0)  # worker Stats are polled every 0.5 s: start from a fresh reading
    before = text()
    queried_before = prometheus_sum(before, "tandem:prefix_cache_queries_total", 'role="prefill"')
    received_before = prometheus_sum(before, "tandem:kv_transfer_bytes_total", 'role="decode"')
    answer = client(disagg_server).completions.create(model="smollm2-135m-instruct", prompt="[cluster metrics] The sea",
                                                      max_tokens=3, temperature=0)
    prompt_tokens = answer.usage.prompt_tokens
    wait_until(lambda: prometheus_sum(text(), "tandem:prefix_cache_queries_total", 'role="prefill"')
               >= queried_before + prompt_tokens, what="the prefill worker's lookups in /metrics")
    # SmolLM2 float32: 30 layers x 2 x 3 KV heads x 64 x 4 bytes per prompt position
    wait_until(lambda: prometheus_sum(text(), "tandem:kv_transfer_bytes_total", 'role="decode"') - received_before
               == prompt_tokens * 46080, what="the KV bytes the decode worker received")
    assert 'model_name="smollm2-135m-instruct"' in text()
    wait_until(lambda: prometheus_sum(text(), "tandem:kv_cache_usage_perc") == 0.0, what="KV usage back to idle")
    assert prometheus_sum(text(), "tandem:num_requests_waiting") == 0


def test_prefill_chunk_sizes_are_a_histogram_in_metrics(colocated_server, disagg_server):
    """tandem:prefill_chunk_tokens per worker: a prompt computed alone (nothing decoding
    beside it) goes in one step, whatever --max-step-ms; the histogram counts it where it ran."""
    for server, role in ((colocated_server, "decode"), (disagg_server, "prefill")):
        text = lambda: httpx.get(f"{server.base_url}/metrics", timeout=10).text  # noqa: E731
        time.sleep(1.0)  # a fresh Stats poll
        before = text()
        count_before = prometheus_sum(before, "tandem:prefill_chunk_tokens_count", f'role="{role}"')
        sum_before = prometheus_sum(before, "tandem:prefill_chunk_tokens_sum", f'role="{role}"')
        answer = client(server).completions.create(model="smollm2-135m-instruct", prompt=f"[chunks {role}] The sea is",
                                                   max_tokens=2, temperature=0)
        wait_until(lambda: prometheus_sum(text(), "tandem:prefill_chunk_tokens_sum", f'role="{role}"') - sum_before
                   >= answer.usage.prompt_tokens, what=f"the {role} worker's prompt tokens in the chunk histogram")
        after = text()
        assert prometheus_sum(after, "tandem:prefill_chunk_tokens_count", f'role="{role}"') >= count_before + 1
        from prometheus_client.parser import text_string_to_metric_families

        (family,) = [f for f in text_string_to_metric_families(after) if f.name == "tandem:prefill_chunk_tokens"]
        buckets = [s for s in family.samples if s.name.endswith("_bucket") and s.labels["role"] == role]
        counts = [s.value for s in sorted(buckets, key=lambda s: float(s.labels["le"]))]
        assert counts == sorted(counts) and counts[-1] == prometheus_sum(
            after, "tandem:prefill_chunk_tokens_count", f'role="{role}"')  # cumulative, ending at the count


def test_max_step_ms_flag_and_environment():
    from cluster.cli import build_parser
    from engine.step_budget import DEFAULT_MAX_STEP_MS

    parse = lambda *flags: build_parser().parse_args(["serve", *flags]).max_step_ms  # noqa: E731
    assert parse() == DEFAULT_MAX_STEP_MS and parse("--max-step-ms", "40") == 40.0
    assert parse("--max-step-ms", "off") is None
    with pytest.raises(SystemExit):
        parse("--max-step-ms", "-3")


def test_auto_mode_on_one_node_is_colocated_and_says_why(colocated_server):
    """colocated_server is started without --mode, as `make serve` is: on this one machine
    every worker would share its cores, so auto must choose one colocated worker pool."""
    assert colocated_server.mode == "colocated"
    said = [line for line in colocated_server.log if "] mode: " in line]
    assert len(said) == 1 and "auto: prefill and decode workers would share one node's CPU cores" in said[0]
    assert any("workers: decode on the CPU" in line for line in colocated_server.log)
    assert not any("prefill on" in line for line in colocated_server.log)  # no prefill pool
    assert any("serving smollm2-135m-instruct (colocated)" in line for line in colocated_server.log)


def long_prompt_mid_stream(server, llm, while_streaming=None) -> tuple[int, int, int]:
    """Two streams decode on ``server``'s colocated worker and a prompt of 256+ tokens arrives
    mid-stream; every answer must equal LLM.generate's (near-tie rule). ``while_streaming`` is
    called once both streams have their first tokens, before the long prompt is sent. Returns the
    worker's lane prompts and lane prompt tokens from before, and the long prompt's token count."""
    tokenizer = llm.get_tokenizer()
    long_prompt = "[lane] " + " ".join(f"Chapter {i}: the tide came in over the grey stones." for i in range(30))
    num_long = len(tokenizer.encode(long_prompt))
    assert num_long >= 256
    streams = ["[lane] The sea is", "[lane] Once upon a time"]
    stream_params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True, logprobs=2)
    stream_refs = [r.outputs[0] for r in llm.generate(streams, stream_params)]
    long_ref = llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=16, logprobs=2))[0].outputs[0]
    time.sleep(1.0)  # a fresh Stats poll
    lane_prompts = server.metric("num_lane_prompts", "decode")
    lane_tokens = server.metric("num_lane_prompt_tokens", "decode")

    tokens: list[list[str]] = [[], []]
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": streams[i], "max_tokens": 160, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 2}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens[i] += (choice.get("logprobs") or {}).get("tokens") or []
                    started[i].set()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    assert all(event.wait(60) for event in started), "the streams did not start"
    if while_streaming is not None:
        while_streaming()
    answer = client(server).completions.create(model="smollm2-135m-instruct", prompt=long_prompt, max_tokens=16,
                                               temperature=0, logprobs=2)
    for thread in threads:
        thread.join(120)
    assert answer.usage.prompt_tokens == num_long
    stats = EqualityStats()
    assert_same_tokens_as_text(answer.choices[0].logprobs.tokens, long_ref, stats, label="the long prompt")
    for i, reference in enumerate(stream_refs):  # the streams decoded beside it, unharmed
        assert len(tokens[i]) == 160
        assert_same_tokens_as_text(tokens[i], reference, stats, label=streams[i])
    assert stats.near_ties <= 1
    return lane_prompts, lane_tokens, num_long


@pytest.fixture(scope="module")
def lane_first_server(smollm_dir):
    """A live colocated worker with two threads and the prefill lane under policy first."""
    server = start_server(smollm_dir, "colocated", "--worker-threads", "2", "--prefill-lane-min-tokens", "128",
                          "--prefill-lane-policy", "first", env=fault_env())
    yield server
    server.stop()


def test_a_lane_prompt_that_fails_after_its_stream_ended_fails_alone_on_a_live_worker(lane_first_server):
    """A short stream decodes; a ~600-token prompt whose sampling fails (the injected fault)
    goes to the lane, and the stream (64 tokens) often ends while the lane, on one float32
    thread, still computes it, so the engine thread, with nothing to step, computes its last
    layers and samples (PrefillLane.help); the test holds either way. The prompt gets a
    500 with the fault's message; the stream its tokens; no KV block stays held, and the worker
    serves the next request."""
    server = lane_first_server
    url, lane_before = server.base_url, server.metric("num_lane_prompts", "decode")
    # 64 tokens: on a fast CPU a 24-token stream could end before the long prompt came, and with
    # no stream decoding the steps, not the lane, read it
    stream = {"model": "smollm2-135m-instruct", "prompt": "Count:", "max_tokens": 64, "ignore_eos": True,
              "temperature": 0.0}
    faulted = {"model": "smollm2-135m-instruct", "prompt": " ".join(f"item{i}" for i in range(150)),
               "max_tokens": 4, "temperature": 0.7, "seed": FAULT_SEED}

    async def run():
        async with httpx.AsyncClient(timeout=300) as http:
            streamed = asyncio.create_task(http.post(f"{url}/v1/completions", json=stream))
            await asyncio.sleep(0.2)  # the stream decodes when the long prompt arrives
            return await asyncio.gather(streamed, http.post(f"{url}/v1/completions", json=faulted))

    streamed, failed = asyncio.run(run())
    assert streamed.status_code == 200 and streamed.json()["choices"][0]["finish_reason"] == "length"
    assert failed.status_code == 500, failed.text
    assert "fault injected by the test" in failed.json()["error"]["message"]
    wait_until(lambda: server.metric("num_lane_prompts", "decode") == lane_before + 1,  # it went through the lane
               what="the lane's prompt in Stats")
    wait_until(lambda: server.metric("num_free_kv_blocks", "decode") == server.metric("num_kv_blocks", "decode")
               and server.metric("num_running", "decode") == 0, what="the worker to hold no KV block")
    after = httpx.post(f"{url}/v1/completions", json=stream, timeout=120)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"


def test_a_long_prompt_arriving_mid_stream_goes_through_the_prefill_lane(lane_first_server, llm):
    """Lane policy first: a prompt of 128+ tokens that arrives while two streams decode is read
    on the prefill lane (its Stats count it, token for token), and every answer equals
    LLM.generate's: the lane's KV went into the prompt's own blocks only."""
    from bench.compare import worker_totals

    server = lane_first_server
    assert any("prefill lane: a prompt of 128+ tokens" in line for line in server.log), server.log[-5:]
    totals = lambda: worker_totals(f"{server.base_url}/v1")  # noqa: E731  (what `tandem bench compare` reads)
    steps = lambda t: t["num_decode_steps"] + t["num_prompt_steps"]  # noqa: E731
    steps_before = steps(totals())
    lane_prompts, lane_tokens, num_long = long_prompt_mid_stream(server, llm)
    wait_until(lambda: server.metric("num_lane_prompts", "decode") > lane_prompts, what="the lane in Stats")
    assert server.metric("num_lane_prompts", "decode") == lane_prompts + 1  # the long prompt alone
    assert server.metric("num_lane_prompt_tokens", "decode") == lane_tokens + num_long
    after = totals()
    assert after["num_lane_prompts"] == lane_prompts + 1 and 0 < after["lane_busy_ms"] < 60_000
    # what the engine measured of the prompt's cost to the streams (the `cost` policy's inputs): the lane's
    # ms per prompt token on its thread (a moving average over its prompts: a float32 token on one thread takes ms)
    assert 0 < after["lane_ms_per_token"] < 1000
    assert after["lane_slowdown"] > 0  # the streams decoded beside the lane, and apart from it before
    # the streams' 160 tokens each came from at least 159 steps (Stats is polled: wait for the last of them)
    def stepped():
        now = totals()
        return now if steps(now) - steps_before >= 159 else None

    after = wait_until(stepped, timeout_s=10, what="the streams' steps in Stats")
    assert after["decode_steps_seqs"] >= after["num_decode_steps"] > 0 and after["decode_steps_ms"] > 0


def test_a_prompt_whose_client_leaves_while_it_waits_for_the_lane_is_dropped(lane_first_server, llm):
    """A stream decodes; a prompt of ~900 tokens goes to the lane (seconds on one float32
    thread), and a second one queues behind it there. The second one's client gives up after
    half a second. It is dropped from the lane's queue: never computed, nothing of it left
    running or holding a block. The first prompt and the stream answer as LLM.generate does,
    and the server serves on."""
    server = lane_first_server
    tokenizer = llm.get_tokenizer()
    ahead = "[gone] " + " ".join(f"Verse {i}: the wind went over the hill and down to the sea." for i in range(52))
    behind = "[gone] " + " ".join(f"Line {i}: a cart rolled slowly past the old mill at dusk." for i in range(52))
    num_ahead, num_behind = (len(tokenizer.encode(p)) for p in (ahead, behind))
    assert 800 <= num_ahead <= 1000 and 800 <= num_behind <= 1000
    stream_prompt = "[gone] The river"
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, logprobs=2)
    stream_ref = llm.generate([stream_prompt], params)[0].outputs[0]
    ahead_ref = llm.generate([ahead], SamplingParams(temperature=0.0, max_tokens=8, logprobs=2))[0].outputs[0]
    time.sleep(1.0)  # a fresh Stats poll
    lane_prompts = server.metric("num_lane_prompts", "decode")
    lane_tokens = server.metric("num_lane_prompt_tokens", "decode")
    generated = server.metric("num_generation_tokens", "decode")
    tokens: list[str] = []
    started = threading.Event()
    answers = []

    def stream() -> None:
        body = {"model": "smollm2-135m-instruct", "prompt": stream_prompt, "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True, "logprobs": 2}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    tokens.extend((json.loads(line[6:])["choices"][0].get("logprobs") or {}).get("tokens") or [])
                    started.set()

    def ask_ahead() -> None:
        answers.append(client(server).completions.create(model="smollm2-135m-instruct", prompt=ahead, max_tokens=8,
                                                         temperature=0, logprobs=2))

    threads = [threading.Thread(target=stream)]
    threads[0].start()
    assert started.wait(60), "the stream did not start"
    threads.append(threading.Thread(target=ask_ahead))
    threads[1].start()
    time.sleep(0.3)  # the first prompt is on the lane
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", timeout=0.5,
                   json={"model": "smollm2-135m-instruct", "prompt": behind, "max_tokens": 8, "temperature": 0})
    for thread in threads:
        thread.join(120)
    assert answers and answers[0].usage.prompt_tokens == num_ahead
    stats = EqualityStats()
    assert_same_tokens_as_text(answers[0].choices[0].logprobs.tokens, ahead_ref, stats, label="the prompt ahead")
    assert len(tokens) == 200
    assert_same_tokens_as_text(tokens, stream_ref, stats, label=stream_prompt)
    assert stats.near_ties <= 1
    wait_until(lambda: server.metric("num_free_kv_blocks", "decode") == server.metric("num_kv_blocks", "decode")
               and server.metric("num_running", "decode") == 0, what="the worker idle with every block free")
    time.sleep(1.0)  # had the abandoned prompt been computed, the next poll would count it
    assert server.metric("num_lane_prompts", "decode") == lane_prompts + 1  # the prompt ahead alone
    assert server.metric("num_lane_prompt_tokens", "decode") == lane_tokens + num_ahead
    emitted = 200 + answers[0].usage.completion_tokens
    assert server.metric("num_generation_tokens", "decode") == generated + emitted  # nothing for the one gone
    after = client(server).completions.create(model="smollm2-135m-instruct", prompt="[gone] Hello", max_tokens=3,
                                              temperature=0)
    assert after.usage.completion_tokens == 3


def test_under_the_overflow_policy_a_lone_long_prompt_is_read_in_the_steps(smollm_dir, llm):
    """`--prefill-lane-policy overflow` reaches the live worker: the same long prompt, arriving
    alone while two streams decode, is read in the steps on both threads, not on the lane, with
    the same answers (the engine-level tests send the lane what overflows)."""
    server = start_server(smollm_dir, "colocated", "--worker-threads", "2", "--prefill-lane-min-tokens", "128",
                          "--prefill-lane-policy", "overflow")
    try:
        assert any("finds other prefill work under way (policy overflow)" in line for line in server.log), \
            server.log[-5:]
        lane_prompts, lane_tokens, _ = long_prompt_mid_stream(server, llm)
        time.sleep(1.5)  # two Stats polls after the answer
        assert server.metric("num_lane_prompts", "decode") == lane_prompts
        assert server.metric("num_lane_prompt_tokens", "decode") == lane_tokens
    finally:
        server.stop()


def test_under_the_pace_policy_the_lane_takes_a_prompt_when_the_streams_are_slower_than_the_bound(smollm_dir, llm):
    """`--prefill-lane-policy pace` and its bound reach the live worker, and the worker measures
    its streams' pace: with a bound of 0.5 ms, which any decode step exceeds, the long prompt
    that arrives while two streams decode goes to the lane (with no pace measured, it would be
    read in the steps), with the same answers as LLM.generate. The engine-level tests cover the
    bound's other side."""
    server = start_server(smollm_dir, "colocated", "--worker-threads", "2", "--prefill-lane-min-tokens", "128",
                          "--prefill-lane-policy", "pace", "--prefill-lane-pace-ms", "0.5")
    try:
        assert any("more than 0.5 ms apart (policy pace)" in line for line in server.log), server.log[-5:]
        pace = lambda: server.metric("stream_pace_ms", "decode")  # noqa: E731
        wait_until(lambda: pace() == 0.0, timeout_s=10, what="no pace while nothing decodes")  # after warm-up
        paces: list[float] = []
        # while the two streams decode, /metrics reports their pace (a step of two real decodes takes ms)
        lane_prompts, lane_tokens, num_long = long_prompt_mid_stream(
            server, llm, while_streaming=lambda: paces.append(wait_until(pace, timeout_s=10, what="a pace")))
        assert 0.5 < paces[0] < 10000.0, paces
        wait_until(lambda: server.metric("num_lane_prompts", "decode") > lane_prompts, what="the lane in Stats")
        assert server.metric("num_lane_prompts", "decode") == lane_prompts + 1
        assert server.metric("num_lane_prompt_tokens", "decode") == lane_tokens + num_long
        wait_until(lambda: pace() == 0.0, timeout_s=10, what="no pace once the streams are done")
    finally:
        server.stop()
