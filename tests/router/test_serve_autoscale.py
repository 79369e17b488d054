"""Pool autoscaling on a live `tandem serve` (real Ray actors, real gRPC, real HTTP): a burst of
long prompts grows the prefill pool, quiet shrinks it, and every request on the way comes back
with the reference's tokens."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import openai
import psutil
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from tests.reference import EqualityStats, assert_same_tokens_as_text
from tests.router.conftest import start_server
from tests.workers import wait_until

MODEL = "smollm2-135m-instruct"
# the decode test's output length: long enough that 8 sequences on 2 slots keep some waiting for
# several autoscaling windows even on a fast CPU (at 24 tokens a family-26 EPYC served the whole
# burst in about the 1 s window, and the pool never grew)
DECODE_TOKENS = 96


def pool_metrics(server) -> dict:
    """{(name, role, state-or-event): value} for the pool families in /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("tandem:pool_"):
                key = sample.labels.get("state") or sample.labels.get("event") or sample.labels.get("bound", "")
                values[(sample.name, sample.labels["role"], key)] = sample.value
    return values


def ready_workers(server, role: str) -> float:
    return pool_metrics(server)[("tandem:pool_workers", role, "ready")]


def scaling_events(server, role: str, event: str) -> float:
    return pool_metrics(server)[("tandem:pool_scaling_events_total", role, event)]


def worker_counter(server, field: str, role: str) -> dict[str, float]:
    """A Stats field per worker address of ``role`` (``tandem:worker_<field>``)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {sample.labels["address"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == f"tandem:worker_{field}" and sample.labels["role"] == role}


def both_worked(server, field: str, role: str) -> bool:
    counts = worker_counter(server, field, role)
    return len(counts) == 2 and min(counts.values()) > 0


def worker_actors(server) -> int:
    """Live worker actor processes under this server (Ray titles them ``ray::WorkerActor``)."""
    count = 0
    for process in server.descendants():
        try:
            count += " ".join(process.cmdline()).startswith("ray::WorkerActor")
        except psutil.Error:
            pass
    return count


def test_prefill_pool_grows_under_a_burst_and_shrinks_when_quiet(smollm_dir, llm):
    server = start_server(smollm_dir, "disagg", "--prefill-workers", "1:2", "--local-prefill-max-tokens", "0",
                          "--prefill-queue-target", "256", "--scale-up-window", "1", "--scale-down-window", "6",
                          "--autoscale-interval", "0.25")
    try:
        metrics = pool_metrics(server)
        assert metrics[("tandem:pool_size_bounds", "prefill", "min")] == 1
        assert metrics[("tandem:pool_size_bounds", "prefill", "max")] == 2
        assert ready_workers(server, "prefill") == 1 and worker_actors(server) == 2
        rng = random.Random(7)
        # distinct token-id prompts (no shared prefix to cache), long enough to queue on one worker
        prompts = [[rng.randrange(200, 40000) for _ in range(320)] for _ in range(32)]
        # and short ones for a trickle that leaves the pool quiet (under half the target)
        prompts += [[rng.randrange(200, 40000) for _ in range(40)] for _ in range(40)]
        params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
        references = [output.outputs[0] for output in llm.generate(prompts, params)]

        async def one(api: openai.AsyncOpenAI, index: int) -> list[str]:
            reply = await api.completions.create(model=MODEL, prompt=prompts[index], max_tokens=4, temperature=0,
                                                 logprobs=1)
            assert reply.choices[0].finish_reason == "length"
            return reply.choices[0].logprobs.tokens

        async def burst(indices) -> dict[int, list[str]]:  # a client per event loop (asyncio.run)
            async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                          timeout=300) as api:
                return dict(zip(indices, await asyncio.gather(*(one(api, i) for i in indices))))

        answers = asyncio.run(burst(range(0, 16)))  # ~5k prompt tokens queued on one prefill worker
        wait_until(lambda: scaling_events(server, "prefill", "up") == 1, timeout_s=180, what="the prefill pool to grow")
        wait_until(lambda: ready_workers(server, "prefill") == 2, timeout_s=60, what="the new worker to be healthy")
        assert worker_actors(server) == 3
        assert any("autoscaling: prefill worker" in line and "joined" in line for line in server.log)

        # a trickle of requests runs across the shrink: none may fail or change
        trickle: dict[int, list[str]] = {}
        stop = threading.Event()

        def keep_sending() -> None:
            index = 32
            while not stop.is_set() and index < len(prompts):
                trickle.update(asyncio.run(burst([index])))
                index += 1

        second = asyncio.run(burst(range(16, 32)))  # spread over both workers now
        wait_until(lambda: both_worked(server, "num_prompt_tokens_computed", "prefill"), timeout_s=10,
                   what="both prefill workers to have computed prompts")
        sender = threading.Thread(target=keep_sending)
        sender.start()
        try:
            wait_until(lambda: scaling_events(server, "prefill", "down") == 1, timeout_s=120,
                       what="the prefill pool to shrink")
        finally:
            stop.set()
            sender.join(120)
        wait_until(lambda: worker_actors(server) == 2, timeout_s=30, what="the drained actor to exit")
        assert ready_workers(server, "prefill") == 1
        assert pool_metrics(server)[("tandem:pool_workers", "prefill", "draining")] == 0
        assert scaling_events(server, "prefill", "up") == 1 and scaling_events(server, "decode", "up") == 0

        served = {**answers, **second, **trickle}
        assert len(served) >= 33, "the trickle sent nothing"
        stats = EqualityStats()
        for index, tokens in served.items():
            assert_same_tokens_as_text(tokens, references[index], stats, label=f"prompt {index}")
        assert not any("Traceback" in line for line in server.log)
    finally:
        server.stop()


def test_decode_pool_grows_when_sequences_wait_and_shrinks_when_quiet(smollm_dir, llm):
    """Colocated: decode workers hold at most 2 sequences (--max-num-seqs 2), so 8 concurrent
    requests leave sequences waiting; the pool grows to 2, then drains back to 1."""
    server = start_server(smollm_dir, "colocated", "--decode-workers", "1:2", "--max-num-seqs", "2",
                          "--decode-queue-target", "1", "--scale-up-window", "1", "--scale-down-window", "5",
                          "--autoscale-interval", "0.25")
    try:
        assert ready_workers(server, "decode") == 1 and worker_actors(server) == 1
        rng = random.Random(3)
        prompts = [[rng.randrange(200, 40000) for _ in range(24)] for _ in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True, logprobs=2)
        references = [output.outputs[0] for output in llm.generate(prompts, params)]

        async def burst(indices) -> dict[int, list[str]]:
            async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                          timeout=300) as api:
                async def one(index: int) -> list[str]:
                    reply = await api.completions.create(model=MODEL, prompt=prompts[index], max_tokens=DECODE_TOKENS,
                                                         temperature=0, logprobs=1, extra_body={"ignore_eos": True})
                    assert reply.choices[0].finish_reason == "length"
                    return reply.choices[0].logprobs.tokens

                return dict(zip(indices, await asyncio.gather(*(one(i) for i in indices))))

        served = asyncio.run(burst(range(0, 8)))
        wait_until(lambda: scaling_events(server, "decode", "up") == 1, timeout_s=180, what="the decode pool to grow")
        wait_until(lambda: ready_workers(server, "decode") == 2, timeout_s=60, what="the new decode worker")
        assert worker_actors(server) == 2
        served |= asyncio.run(burst(range(8, 16)))  # both workers take sequences now
        wait_until(lambda: both_worked(server, "num_generation_tokens", "decode"), timeout_s=10,
                   what="both decode workers to have generated tokens")
        wait_until(lambda: scaling_events(server, "decode", "down") == 1, timeout_s=120,
                   what="the decode pool to shrink")
        wait_until(lambda: worker_actors(server) == 1, timeout_s=30, what="the drained actor to exit")
        assert ready_workers(server, "decode") == 1
        stats = EqualityStats()
        for index, tokens in served.items():
            assert_same_tokens_as_text(tokens, references[index], stats, label=f"prompt {index}")
        assert len(served) == 16
    finally:
        server.stop()
