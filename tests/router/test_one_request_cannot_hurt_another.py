"""On a live `tandem serve`, in both modes: bad requests sent while ordinary ones run. Each
poison gets a 400 (gRPC INVALID_ARGUMENT) naming its field; a fault inside the engine (the
test's injected one, tests/faults) ends its own request with a 500 and is not retried; every
neighbour gets the tokens `LLM.generate` gives it alone (DESIGN.md's token-equality rule);
afterwards every worker holds no KV block."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import httpx
import pytest

from client import SamplingParams as ClientParams
from client import TandemClient, TandemError
from engine import SamplingParams
from proto import generation_pb2 as gen_pb
from proto import generation_pb2_grpc as gen_grpc
from tests.reference import EqualityStats, assert_same_tokens_as_text
from tests.router.conftest import FAULT_SEED
from tests.workers import wait_until

MODEL = "smollm2-135m-instruct"
VOCAB = 49152  # SmolLM2's vocabulary: ids [0, 49152)
NEIGHBOURS = ["[isolation] The sea is", "[isolation] Once upon a time"]


def poisons(max_queue: int) -> list[tuple[str, dict, str]]:
    """(what, body, the param its 400 must name): the issue's three, then one per rule."""
    return [
        ("stop id past the vocabulary", {"prompt": "hi", "max_tokens": 8, "min_tokens": 2,
                                         "stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ("seed past 64 bits", {"prompt": "hi", "seed": 2**70}, "seed"),
        ("negative token id", {"prompt": [[-5, 3]]}, "prompt"),
        ("token id past the vocabulary", {"prompt": [3, VOCAB]}, "prompt"),
        ("negative seed", {"prompt": "hi", "seed": -1}, "seed"),
        ("top_k past int32", {"prompt": "hi", "top_k": 2**40}, "top_k"),
        ("max_tokens past uint32", {"prompt": "hi", "max_tokens": 2**33}, "max_tokens"),
        ("min_tokens past uint32", {"prompt": "hi", "min_tokens": 2**33}, "min_tokens"),
        ("min_tokens over max_tokens", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ("logprobs over 20", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("NaN temperature", {"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ("n over --max-n", {"prompt": "hi", "n": 17}, "n"),
        ("prompts over --max-prompts-per-request", {"prompt": ["hi"] * 65}, "prompt"),
        ("prompts x n over --max-queue", {"prompt": ["hi"] * (max_queue // 16 + 1), "n": 16}, "n"),
        ("stop strings over --max-stop-strings", {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, "stop"),
        ("stop string over --max-stop-string-len", {"prompt": "hi", "stop": "x" * 257}, "stop"),
        ("empty stop string", {"prompt": "hi", "stop": [""]}, "stop"),
        ("text over --max-input-chars", {"prompt": "x" * ((1 << 20) + 1)}, "prompt"),
        ("empty prompt", {"prompt": []}, "prompt"),
        ("prompt past the context", {"prompt": "word " * 1100}, "prompt"),
        ("image part in a message", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages.0"),
    ]


def _post(url: str, path: str, body: dict, headers: dict, timeout: float = 120) -> httpx.Response:
    # json.dumps writes NaN as the bare token NaN, which Python's JSON reader (FastAPI's) accepts
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=timeout,
                      headers={**headers, "Content-Type": "application/json"})


async def _neighbour(http: httpx.AsyncClient, url: str, prompt: str, started: asyncio.Event,
                     request_id: str | None = None) -> tuple[list[str], str]:
    """Streams one greedy completion; returns each token's text (from logprobs) and the id header."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 96, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "stream": True}
    headers = {"X-Request-Id": request_id} if request_id else {}
    tokens: list[str] = []
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            tokens += event["choices"][0]["logprobs"]["tokens"]
            started.set()
        return tokens, response.headers["x-request-id"]


def _retries(server) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    found = re.search(r'^tandem:routing_decisions_total\{decision="retry"\} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def _references(llm) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True, logprobs=2)
    return {prompt: output.outputs[0] for prompt, output in zip(NEIGHBOURS, llm.generate(NEIGHBOURS, params))}


def _grpc_poisons(server) -> list[tuple[str, object, str]]:
    """The same rules over the public gRPC API: status INVALID_ARGUMENT, the field in the
    trailing metadata tandem-error-param."""
    greedy = ClientParams(temperature=0.0, max_tokens=4)
    return [
        ("stop id past the vocabulary", gen_pb.GenerationRequest(
            model=MODEL, text="hi", params=ClientParams(min_tokens=2, max_tokens=8, stop_token_ids=(VOCAB,)).to_proto()),
         "stop_token_ids"),
        ("token id past the vocabulary", gen_pb.GenerationRequest(
            model=MODEL, token_ids=gen_pb.TokenIds(ids=[3, VOCAB]), params=greedy.to_proto()), "prompt"),
        ("NaN temperature", gen_pb.GenerationRequest(
            model=MODEL, text="hi", params=ClientParams(temperature=float("nan")).to_proto()), "temperature"),
        ("a 70 KB request id", gen_pb.GenerationRequest(
            model=MODEL, text="hi", request_id="r" * 70_000, params=greedy.to_proto()), "request_id"),
        ("request id with a newline", gen_pb.GenerationRequest(
            model=MODEL, text="hi", request_id="a\nb", params=greedy.to_proto()), "request_id"),
        ("n over --max-n", gen_pb.GenerationRequest(model=MODEL, text="hi", n=17, params=greedy.to_proto()), "n"),
    ]


def _check_grpc_poisons(server) -> None:
    metadata = (("authorization", f"Bearer {server.api_key}"),) if server.api_key else ()
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for what, request, param in _grpc_poisons(server):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request, metadata=metadata, timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, info.value)
            trailer = dict(info.value.trailing_metadata() or ())
            assert trailer.get("tandem-error-param") == param, (what, trailer, info.value.details())
    with TandemClient(server.grpc_target, api_key=server.api_key) as tandem:  # the SDK says which field
        with pytest.raises(TandemError) as info:
            tandem.complete("hi", ClientParams(min_tokens=2, max_tokens=8, stop_token_ids=(VOCAB,)))
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and info.value.param == "stop_token_ids"


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_poison_requests_leave_their_neighbours_alone(mode, request, llm):
    server = request.getfixturevalue(f"{mode}_server")
    max_queue = 3 if mode == "colocated" else 256
    references = _references(llm)
    retries_before = _retries(server)
    url, headers = server.base_url, server.headers
    fault = {"model": MODEL, "prompt": "[isolation] fault", "max_tokens": 8, "temperature": 0.7, "seed": FAULT_SEED}

    async def run() -> tuple[list, list, httpx.Response]:
        started = [asyncio.Event() for _ in NEIGHBOURS]
        async with httpx.AsyncClient(timeout=300, headers=headers) as http:
            tasks = [asyncio.create_task(_neighbour(http, url, p, e)) for p, e in zip(NEIGHBOURS, started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)  # both are decoding
            refused = [await asyncio.to_thread(_post, url, "/v1/completions" if "prompt" in body
                                               else "/v1/chat/completions", {"model": MODEL, **body}, headers)
                       for _, body, _ in poisons(max_queue)]
            await asyncio.to_thread(_check_grpc_poisons, server)
            faulted = await http.post(f"{url}/v1/completions", json=fault)
            assert not any(task.done() for task in tasks), "the neighbours finished before the poisons were sent"
            return await asyncio.gather(*tasks), refused, faulted

    neighbours, refused, faulted = asyncio.run(run())
    for (what, _, param), response in zip(poisons(max_queue), refused):
        assert response.status_code == 400, (what, response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["param"] == param and error["code"] == 400 and error["type"] == "BadRequestError", (what, error)
        assert error["message"], what
    assert faulted.status_code == 500, faulted.text
    error = faulted.json()["error"]
    assert error["type"] == "InternalServerError" and "fault injected by the test" in error["message"], error
    stats = EqualityStats()
    for prompt, (tokens, _) in zip(NEIGHBOURS, neighbours):
        assert_same_tokens_as_text(tokens, references[prompt], stats, label=f"{mode}: {prompt}")
    print(f"{mode}: neighbours vs alone, near-tie rule fired {stats.near_ties} of {stats.compared}")
    assert stats.near_ties <= 1
    assert _retries(server) == retries_before, "a request-specific error was retried"
    roles = ("prefill", "decode") if mode == "disagg" else ("decode",)
    for role in roles:
        wait_until(lambda: server.metric("num_free_kv_blocks", role) == server.metric("num_kv_blocks", role)
                   and server.metric("num_running", role) == 0, what=f"{role} workers hold no KV block")


def test_two_clients_with_the_same_request_id_get_their_own_answers(disagg_server, llm):
    references = _references(llm)

    async def run():
        started = [asyncio.Event() for _ in NEIGHBOURS]
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(_neighbour(http, disagg_server.base_url, prompt, event, "same-id-7")
                                          for prompt, event in zip(NEIGHBOURS, started)))

    stats = EqualityStats()
    for prompt, (tokens, echoed) in zip(NEIGHBOURS, asyncio.run(run())):
        assert echoed == "same-id-7"  # the client's id is kept where the client sees it
        assert_same_tokens_as_text(tokens, references[prompt], stats, label=prompt)
    assert stats.near_ties <= 1
    too_long = httpx.post(f"{disagg_server.base_url}/v1/completions", json={"model": MODEL, "prompt": "hi"},
                          headers={"X-Request-Id": "r" * 129}, timeout=30)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "X-Request-Id"
    assert too_long.headers["x-request-id"] != "r" * 129


def test_tokenize_endpoints_count_against_admission(colocated_server):
    """--max-queue 3: three streams in flight, and /tokenize waits its turn like a request."""
    url, headers = colocated_server.base_url, colocated_server.headers
    body = {"model": MODEL, "prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=headers) as http:
        streams = [http.stream("POST", f"{url}/v1/completions", json=body) for _ in range(3)]
        lines = [s.__enter__().iter_lines() for s in streams]
        for stream_lines in lines:
            next(stream_lines)
        tokenize = http.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello"})
        detokenize = http.post(f"{url}/detokenize", json={"model": MODEL, "tokens": [1, 2]})
        for stream in streams:
            stream.__exit__(None, None, None)
    assert tokenize.status_code == 429 and detokenize.status_code == 429, (tokenize.text, detokenize.text)
    wait_until(lambda: httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello"},
                                  headers=headers, timeout=10).status_code == 200, what="admission freed")
    over = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "x" * ((1 << 20) + 1)}, headers=headers,
                      timeout=30)
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt"
