"""Mid-stream migration on a live `tandem serve` (disagg: one prefill and one decode worker, real
Ray actors): the decode worker's process is SIGKILLed after a random number of tokens; Ray
restarts it, the router finds the new incarnation and the stream moves there, resuming from
the tokens already sent. Every choice completes equal to an uninterrupted run of the same
request under DESIGN.md's token-equality rule (on the tokens' text, with the reference's top-2
logprob gaps), usage is the uninterrupted run's, and no KV block stays held."""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from tests.chaos.test_lost_workers import assert_nothing_held, counter, worker_addresses, worker_process
from tests.reference import TIE_MARGIN, EqualityStats
from tests.router.conftest import start_server
from tests.workers import wait_until

MODEL = "smollm2-135m-instruct"
PROMPT = "The old lighthouse keeper opened the bottle and read the message inside. It said"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def server(smollm_dir):
    server = start_server(smollm_dir, "disagg", "--local-prefill-max-tokens", "0")
    yield server
    server.stop()


@dataclass
class Choice:
    tokens: list[str] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # top-2 logprob gap per token
    text: str = ""
    finish_reason: str | None = None

    def add(self, choice: dict) -> None:
        self.text += choice["text"]
        logprobs = choice.get("logprobs") or {}
        self.tokens += logprobs.get("tokens") or []
        for top in logprobs.get("top_logprobs") or []:
            best = sorted(top.values(), reverse=True)
            self.gaps.append(best[0] - best[1])
        self.finish_reason = choice.get("finish_reason") or self.finish_reason


@dataclass
class Answer:
    choices: dict[int, Choice] = field(default_factory=dict)
    usage: dict | None = None

    def add(self, body: dict) -> None:
        for choice in body.get("choices") or []:
            self.choices.setdefault(choice["index"], Choice()).add(choice)
        self.usage = body.get("usage") or self.usage


def body_for(case: dict, stream: bool) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "logprobs": 2,
            **case, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def ask(server, body: dict, on_token=None) -> Answer:
    """One request; streamed ones call ``on_token(tokens of choice 0 so far)`` after each event."""
    answer = Answer()
    if not body["stream"]:
        response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=300)
        assert response.status_code == 200, response.text
        answer.add(response.json())
        return answer
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            answer.add(event)
            if on_token is not None and 0 in answer.choices:
                on_token(len(answer.choices[0].tokens))
    return answer


def assert_equal_under_the_rule(ours: Answer, reference: Answer, stats: EqualityStats, label: str) -> None:
    assert sorted(ours.choices) == sorted(reference.choices), label
    for index, theirs in reference.choices.items():
        mine = ours.choices[index]
        stats.compared += 1
        diverged = next((p for p, (a, b) in enumerate(zip(mine.tokens, theirs.tokens)) if a != b), None)
        if diverged is not None:
            assert theirs.gaps[diverged] < TIE_MARGIN, (
                f"{label} choice {index}: diverged at {diverged}: {mine.tokens[diverged]!r} vs "
                f"{theirs.tokens[diverged]!r}, reference gap {theirs.gaps[diverged]:.2e} is not a near-tie")
            stats.near_ties += 1
            continue
        assert mine.tokens == theirs.tokens and mine.text == theirs.text, f"{label} choice {index}"
        assert len(mine.gaps) == len(mine.tokens) == MAX_TOKENS and mine.finish_reason == "length", label
    assert ours.usage["prompt_tokens"] == reference.usage["prompt_tokens"], label
    assert ours.usage["completion_tokens"] == reference.usage["completion_tokens"] == MAX_TOKENS * len(ours.choices)


def decode_worker_killer(server):
    """A function that SIGKILLs the decode worker and returns its address. The process is
    looked up now, not at the kill: the lookup (the router's /metrics, then every process's
    sockets) can take longer than the last tokens of a request on a fast CPU, and a kill
    that lands after the answer migrates nothing."""
    [address] = worker_addresses(server, "decode")
    process = worker_process(server, address)

    def kill() -> str:
        process.send_signal(signal.SIGKILL)
        return address

    return kill


CASES = {
    "greedy": {"temperature": 0},
    "seeded": {"temperature": 0.8, "seed": 1234},
    "n2": {"temperature": 0.8, "seed": 99, "n": 2},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_decode_worker_killed_mid_stream_loses_no_request(server, case, stream):
    body = body_for(CASES[case], stream)
    started = time.monotonic()
    reference = ask(server, body)
    took = time.monotonic() - started
    draw = random.Random(f"{case}-{stream}")
    migrated_before = counter(server, "tandem:routing_decisions_total", 'decision="migrate"')
    kill_decode_worker = decode_worker_killer(server)
    killed: list[str] = []

    if stream:
        cut_at = draw.randrange(1, MAX_TOKENS - 5)

        def on_token(count: int) -> None:
            if count >= cut_at and not killed:
                killed.append(kill_decode_worker())

        ours = ask(server, body, on_token)
    else:  # the client sees no token before the end: kill somewhere in the middle of the run
        timer = threading.Timer(took * draw.uniform(0.45, 0.7), lambda: killed.append(kill_decode_worker()))
        timer.start()
        ours = ask(server, body)
        timer.join()
    assert killed, "the worker was not killed while the request ran"
    stats = EqualityStats()
    assert_equal_under_the_rule(ours, reference, stats, f"{case} ({'streamed' if stream else 'whole'})")
    assert stats.near_ties <= 1
    moved = counter(server, "tandem:routing_decisions_total", 'decision="migrate"') - migrated_before
    assert moved == len(reference.choices), f"{moved} migrations for {len(reference.choices)} choices"
    wait_until(lambda: worker_addresses(server, "decode") not in ([], killed), timeout_s=120,
               what="the restarted decode worker in the pool")
    wait_until(lambda: server.metric("num_kv_blocks", "decode") > 0, what="the new decode worker's Stats")
    assert_nothing_held(server)
