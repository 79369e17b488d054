"""Traffic classes on a live `tandem serve --scheduling-policy priority --traffic-classes FILE`
(real Ray, real workers, real HTTP and gRPC): classes and priorities on every API, the
router's queue by class, SLO-aware shedding that computes nothing, per-class metrics, and
tenant salts. Outputs are compared with `LLM.generate` under DESIGN.md's rule."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest

from client import TandemClient, TandemError
from client import SamplingParams as ClientParams
from engine import SamplingParams
from tests.reference import EqualityStats, assert_same_tokens_as_text
from tests.router.conftest import start_server
from tests.router.test_serve import prometheus_sum

MODEL = "smollm2-135m-instruct"
CLASSES = """
interactive: {priority: 0, ttft_ms: 20000, tpot_ms: 500}
batch: {priority: 10, ttft_ms: 600000, sheddable: true}
hopeless: {priority: 20, ttft_ms: 0.001, sheddable: true}
"""


@pytest.fixture(scope="module")
def priority_server(smollm_dir, tmp_path_factory):
    """Colocated, one decode worker that runs one sequence at a time: the router dispatches
    one and queues the rest by class, five sequences at most."""
    path = tmp_path_factory.mktemp("classes") / "classes.yaml"
    path.write_text(CLASSES)
    server = start_server(smollm_dir, "colocated", "--scheduling-policy", "priority", "--traffic-classes", str(path),
                          "--max-num-seqs", "1", "--max-queue", "5")
    yield server
    server.stop()


def completion(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/completions", json={"model": MODEL, **body}, timeout=120)


def test_every_class_generates_the_engines_tokens(priority_server, llm):
    api = openai.OpenAI(base_url=f"{priority_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompts = {"interactive": "The capital of France is", "batch": "List three prime numbers:",
               "default": "Water boils at"}
    stats = EqualityStats()
    for traffic_class, prompt in prompts.items():
        reference = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, logprobs=2))[0].outputs[0]
        extra = {} if traffic_class == "default" else {"traffic_class": traffic_class}
        answer = api.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                        extra_body=extra)
        assert_same_tokens_as_text(answer.choices[0].logprobs.tokens, reference, stats, traffic_class)
    with TandemClient(priority_server.grpc_target) as tandem:
        answer = tandem.complete(prompts["batch"], ClientParams(temperature=0.0, max_tokens=12),
                                 traffic_class="batch", priority=3, cache_salt="sdk-tenant")
        reference = llm.generate(prompts["batch"], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
        assert answer.choices[0].token_ids == reference.token_ids


def test_unknown_class_and_bad_priority_are_400s_naming_the_field(priority_server, colocated_server):
    for body, param in [({"traffic_class": "gold"}, "traffic_class"), ({"priority": "high"}, "priority"),
                        ({"priority": 1 << 40}, "priority"), ({"cache_salt": ""}, "cache_salt")]:
        response = completion(priority_server, {"prompt": "Hi", "max_tokens": 1, **body})
        assert response.status_code == 400, body
        assert response.json()["error"]["param"] == param
    # a server that schedules fcfs refuses a non-zero priority, as vLLM does
    response = httpx.post(f"{colocated_server.base_url}/v1/completions", headers=colocated_server.headers,
                          json={"model": MODEL, "prompt": "Hi", "max_tokens": 1, "priority": 1}, timeout=60)
    assert response.status_code == 400 and "--scheduling-policy priority" in response.json()["error"]["message"]
    with TandemClient(priority_server.grpc_target) as tandem, pytest.raises(TandemError) as error:
        tandem.complete("Hi", ClientParams(max_tokens=1), traffic_class="gold")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and error.value.param == "traffic_class"


def test_a_higher_class_overtakes_queued_and_running_lower_ones(priority_server):
    """The worker runs one sequence at a time: while a long batch request runs, three batch
    requests queue at the router, then an interactive one comes. It is dispatched at once, the
    decode worker preempts the running batch request for it, and it is answered first; the
    preempted one resumes and all four batch requests finish."""
    finished: list[str] = []
    lock = threading.Lock()

    def send(name: str, traffic_class: str, max_tokens: int) -> None:
        response = completion(priority_server, {"prompt": f"[{name}] Count:", "max_tokens": max_tokens,
                                                "ignore_eos": True, "traffic_class": traffic_class})
        assert response.status_code == 200, response.text
        with lock:
            finished.append(name)

    first = threading.Thread(target=send, args=("running", "batch", 150))
    first.start()
    deadline = time.monotonic() + 60
    while prometheus_sum(httpx.get(f"{priority_server.base_url}/metrics").text, "tandem:num_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    threads = [threading.Thread(target=send, args=(f"batch-{i}", "batch", 8)) for i in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.1)
    queued = lambda: prometheus_sum(httpx.get(f"{priority_server.base_url}/metrics").text,  # noqa: E731
                                    "tandem:num_requests_queued", 'traffic_class="batch"')
    while queued() < 3:
        assert time.monotonic() < deadline, httpx.get(f"{priority_server.base_url}/metrics").text
        time.sleep(0.02)
    preempted = lambda: prometheus_sum(httpx.get(f"{priority_server.base_url}/metrics").text,  # noqa: E731
                                       "tandem:request_preemptions_total", 'traffic_class="batch"')
    preempted_before = preempted()
    urgent = threading.Thread(target=send, args=("interactive", "interactive", 8))
    urgent.start()
    for thread in [first, urgent, *threads]:
        thread.join(120)
    assert finished[0] == "interactive", finished
    assert sorted(finished[1:]) == ["batch-0", "batch-1", "batch-2", "running"]
    assert preempted() - preempted_before >= 1


def wait_for_metric(server, name: str, label: str, value: float, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while prometheus_sum(httpx.get(f"{server.base_url}/metrics").text, name, label) < value:
        assert time.monotonic() < deadline, f"{name}{{{label}}} did not reach {value}"
        time.sleep(0.02)


def test_a_full_queue_sheds_the_newest_lower_class_request_for_a_higher_one(priority_server):
    """--max-queue 5: one batch request runs, four wait at the router; an interactive request
    arrives. The newest batch request is answered 429 (counted as displaced), the interactive
    one is served, and the other four batch requests finish."""
    statuses: dict[str, int] = {}

    def send(name: str, traffic_class: str, max_tokens: int) -> None:
        statuses[name] = completion(priority_server, {"prompt": f"[{name}] Count:", "max_tokens": max_tokens,
                                                      "ignore_eos": True, "traffic_class": traffic_class}).status_code

    label = 'reason="displaced",traffic_class="batch"'
    shed_before = prometheus_sum(httpx.get(f"{priority_server.base_url}/metrics").text, "tandem:requests_shed_total",
                                 label)
    threads = [threading.Thread(target=send, args=("running", "batch", 150))]
    threads[0].start()
    wait_for_metric(priority_server, "tandem:num_requests_running", "", 1)
    for i in range(4):
        threads.append(threading.Thread(target=send, args=(f"batch-{i}", "batch", 4)))
        threads[-1].start()
        wait_for_metric(priority_server, "tandem:num_requests_queued", 'traffic_class="batch"', i + 1)
    send("interactive", "interactive", 4)
    for thread in threads:
        thread.join(120)
    assert statuses == {"running": 200, "batch-0": 200, "batch-1": 200, "batch-2": 200, "batch-3": 429,
                        "interactive": 200}
    assert prometheus_sum(httpx.get(f"{priority_server.base_url}/metrics").text, "tandem:requests_shed_total",
                          label) - shed_before == 1


def test_a_shed_request_computes_nothing_and_is_counted(priority_server):
    url = priority_server.base_url
    time.sleep(1.0)  # worker Stats are polled every 0.5 s: the last test's prompts are counted by now
    before_text = httpx.get(f"{url}/metrics").text
    computed = priority_server.metric("num_prompt_tokens_computed", "decode")
    responses = [completion(priority_server, {"prompt": f"[shed {i}] " + "words " * 200, "max_tokens": 4,
                                              "traffic_class": "hopeless"}) for i in range(3)]
    for response in responses:
        assert response.status_code == 429 and int(response.headers["retry-after"]) >= 1
        assert "hopeless" in response.json()["error"]["message"]
    time.sleep(1.0)  # worker Stats are polled every 0.5 s
    assert priority_server.metric("num_prompt_tokens_computed", "decode") == computed
    after_text = httpx.get(f"{url}/metrics").text
    label = 'traffic_class="hopeless"'
    assert prometheus_sum(after_text, "tandem:requests_shed_total", label) \
        - prometheus_sum(before_text, "tandem:requests_shed_total", label) == 3
    # an interactive request of the same size is never shed: its class is not sheddable
    assert completion(priority_server, {"prompt": "[shed] " + "words " * 200, "max_tokens": 2,
                                        "traffic_class": "interactive"}).status_code == 200


def test_per_class_histograms_count_every_request(priority_server):
    url = priority_server.base_url
    names = ["tandem:time_to_first_token_seconds_count", "tandem:e2e_request_latency_seconds_count",
             "tandem:request_time_per_output_token_seconds_count", "tandem:request_queue_time_seconds_count",
             "tandem:request_prompt_tokens_count", "tandem:request_generation_tokens_count",
             "tandem:inter_token_latency_seconds_count", "tandem:request_generation_tokens_sum"]
    sent = {"interactive": 3, "batch": 2, "default": 1}
    before = httpx.get(f"{url}/metrics").text
    for traffic_class, count in sent.items():
        for i in range(count):
            body = {"prompt": f"[hist {traffic_class} {i}] Hello", "max_tokens": 5, "ignore_eos": True}
            if traffic_class != "default":
                body["traffic_class"] = traffic_class
            assert completion(priority_server, body).status_code == 200
    after = httpx.get(f"{url}/metrics").text
    for traffic_class, count in sent.items():
        label = f'traffic_class="{traffic_class}"'
        delta = {n: prometheus_sum(after, n, label) - prometheus_sum(before, n, label) for n in names}
        for name in names[:6]:
            assert delta[name] == count, (traffic_class, name, delta)
        assert delta["tandem:inter_token_latency_seconds_count"] == 4 * count
        assert delta["tandem:request_generation_tokens_sum"] == 5 * count


def test_tenants_with_different_salts_never_share_blocks(priority_server):
    prompt = "[salt] " + "The quick brown fox jumps over the lazy dog. " * 12

    def cached(salt: str | None) -> int:
        body = {"prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        response = completion(priority_server, body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alice") == 0
    assert cached("bob") == 0  # the same prompt, another tenant: nothing of alice's is reused
    assert cached(None) == 0  # nor by a request without a salt
    assert cached("alice") >= 64  # alice's own blocks are
    assert cached("bob") >= 64
    with TandemClient(priority_server.grpc_target) as tandem:
        assert tandem.complete(prompt, ClientParams(max_tokens=1), cache_salt="carol").usage.cached_tokens == 0
        assert tandem.complete(prompt, ClientParams(max_tokens=1), cache_salt="carol").usage.cached_tokens >= 64


def test_bench_traffic_mix_reports_each_class_as_the_server_counted_it(priority_server):
    """`tandem bench serve --traffic-mix`: the classes drawn travel in the bodies, and each
    class's completed count equals the router's own per-class TTFT count."""
    import asyncio

    from bench.datasets import RandomSpec, make_dataset
    from bench.serve_bench import LoadConfig, run_load, summarize_classes
    from bench.traffic_mix import assign, parse_mix

    mix = parse_mix("interactive:0.5,batch:0.25,hopeless:0.25")
    requests = assign(make_dataset("random", 12, 7, RandomSpec(20, 4)), mix, seed=7)
    assert [r.traffic_class for r in requests] == [r.traffic_class for r in assign(requests, mix, seed=7)]
    drawn = {name: sum(r.traffic_class == name for r in requests) for name in mix}
    assert all(drawn.values()), drawn  # 12 draws: every class present (seeded)
    before = httpx.get(f"{priority_server.base_url}/metrics").text
    # (at most 4 at once: the server holds 5 sequences, and a fifth of a lower class would be shed)
    config = LoadConfig(f"{priority_server.base_url}/v1", MODEL, request_rate=20.0, seed=7, max_concurrency=4)
    results, duration = asyncio.run(run_load(config, requests))
    classes = summarize_classes(results, duration)
    after = httpx.get(f"{priority_server.base_url}/metrics").text
    assert classes["hopeless"]["refused_429"] == drawn["hopeless"] and classes["hopeless"]["completed"] == 0
    for name in ("interactive", "batch"):
        label = f'traffic_class="{name}"'
        counted = prometheus_sum(after, "tandem:time_to_first_token_seconds_count", label) \
            - prometheus_sum(before, "tandem:time_to_first_token_seconds_count", label)
        assert classes[name]["completed"] == drawn[name] == counted
