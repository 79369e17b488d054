"""A live `tandem serve` (disagg: one prefill and one decode worker, real Ray actors) whose
worker processes are SIGKILLed from outside, as an OOM killer or a crash would: requests keep
their answers or get an OpenAI-shaped error (never a hang or wrong tokens), Ray's restarted
worker is found at its new address and takes traffic again, and no KV block stays held.

How fast is a benchmark figure (issue 22's `tandem bench chaos`), not an assertion here; the
waits below are deadlines only."""

from __future__ import annotations

import json
import re
import signal
import time

import httpx
import psutil
import pytest

from tests.router.conftest import FAULTS_DIR, start_server
from tests.workers import wait_until

MODEL = "smollm2-135m-instruct"
# a request seeded with this kills the engine loop of the worker that draws its 12th position
# or later (tests/faults): with a 5-token prompt, the decode worker's
DEATH_SEED, DEATH_POSITION = 31_337, 12
REQUEST_TIMEOUT_S = 10  # the server's --request-timeout: far above what the other tests' requests take


@pytest.fixture(scope="module")
def server(smollm_dir):
    """Every prompt through the prefill worker while there is one (the path under test)."""
    env = {"PYTHONPATH": str(FAULTS_DIR), "TANDEM_TEST_ENGINE_DEATH": f"{DEATH_SEED}:{DEATH_POSITION}"}
    server = start_server(smollm_dir, "disagg", "--local-prefill-max-tokens", "0",
                          "--request-timeout", str(REQUEST_TIMEOUT_S), env=env)
    yield server
    server.stop()


def worker_addresses(server, role: str) -> list[str]:
    """The role's workers in the router's pool, from /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return sorted(set(re.findall(rf'^tandem:worker_num_kv_blocks\{{address="([^"]+)",role="{role}"\}}', text, re.M)))


def worker_process(server, address: str) -> psutil.Process:
    """The process listening on a worker's port (a Ray actor under `tandem serve`)."""
    port = int(address.rsplit(":", 1)[1])
    for process in server.descendants():
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in process.net_connections("tcp")):
                return process
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no process of tandem serve listens on {address}")


def complete(server, prompt: str, timeout_s: float = 60.0) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=timeout_s)


def counter(server, name: str, label: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.search(rf'^{re.escape(name)}\{{{label}\}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def until_answered(server, prompt: str, expected: str, deadline_s: float) -> list[int]:
    """Send the request again and again until it is answered; every answer must be the
    expected text, every failure an OpenAI-shaped error. The statuses seen, in order."""
    statuses, deadline = [], time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        response = complete(server, prompt)
        statuses.append(response.status_code)
        if response.status_code == 200:
            assert response.json()["choices"][0]["text"] == expected
            return statuses
        error = response.json()["error"]
        assert error["message"] and response.status_code >= 500, error
        time.sleep(0.5)
    raise AssertionError(f"not answered within {deadline_s} s: statuses {statuses}")


def assert_nothing_held(server) -> None:
    for role in ("prefill", "decode"):
        wait_until(lambda: server.metric("num_free_kv_blocks", role) == server.metric("num_kv_blocks", role),
                   what=f"every {role} KV block free")


def kill_the_worker(server, role: str, prompt: str) -> tuple[str, str, float]:
    """SIGKILL the role's one worker after answering ``prompt`` once: (that answer, the
    worker's address, when it was killed)."""
    expected = complete(server, prompt).json()["choices"][0]["text"]
    [address] = worker_addresses(server, role)
    worker_process(server, address).send_signal(signal.SIGKILL)
    return expected, address, time.monotonic()


def test_a_killed_prefill_worker_is_survived_and_found_again(server):
    prompt = "The lighthouse keeper wrote in his log that"
    expected, old, killed = kill_the_worker(server, "prefill", prompt)
    # degraded, not down: the decode worker prefills until the prefill worker is back
    statuses = until_answered(server, prompt, expected, deadline_s=60)
    answered = time.monotonic() - killed
    assert httpx.get(f"{server.base_url}/ready", timeout=10).status_code == 200
    wait_until(lambda: worker_addresses(server, "prefill") not in ([], [old]), timeout_s=240,
               what="the restarted prefill worker in the pool")
    print(f"prefill SIGKILL: answered again after {answered:.1f} s (statuses {statuses}), restarted worker in the "
          f"pool after {time.monotonic() - killed:.1f} s")
    [new] = worker_addresses(server, "prefill")
    assert any(f"prefill worker {old} restarted at {new}" in line for line in server.log)
    wait_until(lambda: server.metric("num_kv_blocks", "prefill") > 0, what="the new prefill worker's Stats")
    # it takes traffic again: a fresh prompt is prefilled there, not on the decode worker
    remote_before = counter(server, "tandem:routing_decisions_total", 'decision="remote"')
    computed_before = server.metric("num_prompt_tokens_computed", "prefill")
    wait_until(lambda: complete(server, f"A new prompt at {time.monotonic()}: the sea").status_code == 200
               and server.metric("num_prompt_tokens_computed", "prefill") > computed_before, timeout_s=60,
               what="a prompt prefilled on the restarted prefill worker")
    assert counter(server, "tandem:routing_decisions_total", 'decision="remote"') > remote_before
    assert complete(server, prompt).json()["choices"][0]["text"] == expected
    assert_nothing_held(server)


def test_a_killed_decode_worker_is_found_again_and_answers_as_before(server):
    prompt = "Three things to pack for a long hike:"
    expected, old, killed = kill_the_worker(server, "decode", prompt)
    # its only decode worker gone, requests fail with an OpenAI-shaped error until Ray has
    # restarted it and the router has found it; then they get the same answer
    statuses = until_answered(server, prompt, expected, deadline_s=240)
    print(f"decode SIGKILL: answered again after {time.monotonic() - killed:.1f} s (statuses {statuses})")
    [new] = worker_addresses(server, "decode")
    assert new != old and any(f"decode worker {old} restarted at {new}" in line for line in server.log)
    assert_nothing_held(server)


def test_a_worker_whose_engine_loop_died_exits_and_is_restarted(server):
    """A dead engine loop is reported (the request gets an error), the process exits, Ray
    restarts it and the router finds it again."""
    prompt = "Name one colour of the sea:"
    expected = complete(server, prompt).json()["choices"][0]["text"]
    [old] = worker_addresses(server, "decode")
    pid = worker_process(server, old).pid
    body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 30, "temperature": 0.8, "seed": DEATH_SEED,
            "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code >= 500 and "engine" in response.json()["error"]["message"]
    wait_until(lambda: not psutil.pid_exists(pid), what="the worker's process to exit")
    until_answered(server, prompt, expected, deadline_s=240)
    [new] = worker_addresses(server, "decode")
    assert new != old and worker_process(server, new).pid != pid
    assert_nothing_held(server)


def test_a_request_past_the_request_timeout_ends_with_an_error_event_and_frees_everything(server):
    """--request-timeout on a live server: a stream that would run past it (900 tokens, about
    20-30 s on one thread here) ends with a 504 error event after the tokens so far, then
    [DONE]; the workers drop the request."""
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    elapsed = time.monotonic() - started
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504 and "--request-timeout" in error["message"], error
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert texts and len(texts) < 900  # it was streaming when the deadline came
    assert REQUEST_TIMEOUT_S <= elapsed < REQUEST_TIMEOUT_S + 15
    assert_nothing_held(server)
