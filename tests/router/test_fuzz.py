"""A property-based fuzz of the HTTP API, its requests generated from the server's own
/openapi.json (schemathesis's generators, driven by hypothesis), against a live `tandem serve` with a small
context (--max-model-len 256) on the tiny random model, so that valid requests finish fast.

What must hold for every generated request: no 5xx (in the status or in an SSE error event),
every 4xx body in OpenAI's shape with ``param`` set where a field is at fault; and over the run,
at least 20% of the generation requests reached the engine (answered 200 with tokens), so the
fuzz is not only exercising the validator. Half of the cases are schemathesis's negative ones,
each breaking the schema somewhere. So that a catch-all 400 cannot pass,
a fault injected inside the engine (tests/faults) must still come back as a 500, and after the
run no worker holds a KV block.

Budget: FUZZ_EXAMPLES cases (README states the run time)."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core import NOT_SET
from schemathesis.generation.modes import GenerationMode

from tests.router.conftest import FAULT_SEED, fault_env, start_server
from tests.workers import wait_until

FUZZ_EXAMPLES = 400
MODEL = "smollm2-135m-instruct"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")
GENERATION = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama_dir, smollm_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / "tiny"
    shutil.copytree(tiny_llama_dir, model)
    shutil.copy(smollm_dir / "chat_template.jinja", model / "chat_template.jinja")
    server = start_server(model, "colocated", "--max-model-len", "256", "--max-n", "4", "--worker-threads", "1",
                          env=fault_env())
    yield server
    server.stop()


def _cases(openapi: dict) -> st.SearchStrategy:
    """(path, body): schemathesis's positive cases (what the schema allows) and negative ones
    (each breaking it somewhere), for every POST endpoint."""
    schema = schemathesis.openapi.from_dict(openapi)
    strategies = []
    for path in ENDPOINTS:
        operation = schema[path]["POST"]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            strategies.append(operation.as_strategy(mode).map(lambda case, path=path: (path, case.body)))
    return st.one_of(strategies)


@dataclass
class Tally:
    sent: dict[str, int] = field(default_factory=dict)  # path -> requests
    reached_engine: int = 0  # generation requests answered with tokens
    generation: int = 0
    statuses: dict[int, int] = field(default_factory=dict)


def _check_response(path: str, body: dict, response: httpx.Response, tally: Tally) -> None:
    tally.statuses[response.status_code] = tally.statuses.get(response.status_code, 0) + 1
    assert response.status_code < 500, f"{path} {body!r:.600} -> {response.status_code} {response.text[:600]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, response.text[:600]
        assert error["code"] == response.status_code and error["message"] and error["type"], error
        if response.status_code == 400 and isinstance(body, dict):  # a field is at fault: it is named
            assert error["param"] is not None, f"{path} {json.dumps(body)[:400]} -> 400 without param: {error}"
        return
    if path not in GENERATION:
        return
    tally.generation += 1
    if body.get("stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        decoded = [json.loads(event) for event in events[:-1]]
        errors = [event["error"] for event in decoded if "error" in event]
        assert not errors, f"{path} {json.dumps(body)[:400]} -> stream error {errors}"
        got_tokens = any(choice.get("finish_reason") for event in decoded for choice in event.get("choices", ()))
    else:
        got_tokens = response.json()["usage"]["completion_tokens"] > 0
    tally.reached_engine += int(got_tokens)


def test_fuzz_the_http_api_from_its_openapi(fuzz_server):
    url = fuzz_server.base_url
    openapi = httpx.get(f"{url}/openapi.json", timeout=30).json()
    tally = Tally()
    http = httpx.Client(timeout=120)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_cases(openapi))
    def one(case):
        path, body = case
        tally.sent[path] = tally.sent.get(path, 0) + 1
        if body is NOT_SET:
            content = b""
        else:  # negative cases may be bytes that are not JSON at all
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"})
        _check_response(path, body, response, tally)

    try:
        one()
    finally:
        http.close()
        print(f"fuzz: {sum(tally.sent.values())} requests {tally.sent}, statuses {tally.statuses}, "
              f"{tally.reached_engine} of {tally.generation} generation requests reached the engine")
    generation_sent = sum(tally.sent.get(path, 0) for path in GENERATION)
    assert tally.reached_engine >= 0.2 * generation_sent, tally
    # the harness can tell a 5xx: a fault inside the engine is one
    fault = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4,
                                                      "temperature": 1.0, "seed": FAULT_SEED}, timeout=60)
    with pytest.raises(AssertionError, match="-> 500"):
        _check_response("/v1/completions", {}, fault, Tally())
    wait_until(lambda: fuzz_server.metric("num_free_kv_blocks", "decode") == fuzz_server.metric("num_kv_blocks", "decode")
               and fuzz_server.metric("num_running", "decode") == 0, what="the decode worker holds no KV block")
