"""The public gRPC API on a live `tandem serve`, through the SDK (sync and asyncio) and raw
stubs: same outputs as the HTTP API, health, reflection, every status code from a real bad
call, cancellation, and the SDK in a process where torch, ray and the engine cannot load."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from client import AsyncTandemClient, SamplingParams, TandemClient, TandemError
from proto import generation_pb2 as pb
from proto import generation_pb2_grpc as pb_grpc
from tests.router.conftest import API_KEY, assert_cut_short

MODEL = "smollm2-135m-instruct"
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def http_completion(server, body: dict) -> dict:
    response = httpx.post(f"{server.base_url}/v1/{'chat/' if 'messages' in body else ''}completions",
                          json={"model": MODEL, **body}, headers=server.headers, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_sync_and_async_clients_equal_the_http_api(disagg_server, llm):
    messages = [{"role": "user", "content": "[grpc] What is the capital of France?"}]
    with TandemClient(disagg_server.grpc_target) as tandem:
        text = tandem.complete("[grpc] The sea is", GREEDY)
        http = http_completion(disagg_server, {"prompt": "[grpc] The sea is", "max_tokens": 12, "temperature": 0})
        assert text.choices[0].text == http["choices"][0]["text"]
        assert (text.usage.prompt_tokens, text.usage.completion_tokens) == (
            http["usage"]["prompt_tokens"], http["usage"]["completion_tokens"])
        chat = tandem.chat(messages, GREEDY)
        http_chat = http_completion(disagg_server, {"messages": messages, "max_tokens": 12, "temperature": 0})
        assert chat.choices[0].text == http_chat["choices"][0]["message"]["content"]
        assert chat.usage.prompt_tokens == http_chat["usage"]["prompt_tokens"]
        assert chat.choices[0].finish_reason == http_chat["choices"][0]["finish_reason"]
        ids = tandem.tokenize("[grpc] The sea is")
        assert ids == llm.get_tokenizer().encode("[grpc] The sea is")
        by_ids = tandem.complete(ids, GREEDY)
        assert by_ids.choices[0].token_ids == text.choices[0].token_ids
        chunks = list(tandem.generate("[grpc] The sea is", GREEDY))
        assert "".join(c.text for c in chunks) == text.choices[0].text
        assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        assert [m.id for m in tandem.models()] == [MODEL]

    async def run_async():
        async with AsyncTandemClient(disagg_server.grpc_target) as tandem:
            chat_async = await tandem.chat(messages, GREEDY)
            streamed = [c.text async for c in tandem.generate(messages=messages, params=GREEDY)]
            return chat_async, "".join(streamed)

    chat_async, streamed = asyncio.run(run_async())
    assert chat_async.choices[0].text == streamed == chat.choices[0].text
    assert chat_async.usage.completion_tokens == chat.usage.completion_tokens


def test_health_and_reflection(disagg_server):
    with grpc.insecure_channel(disagg_server.grpc_target) as channel:
        checker = health_pb2_grpc.HealthStub(channel)
        for service in ("", "tandem.v1.Generation"):
            reply = checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=10)
        names = {s.name for reply in replies for s in reply.list_services_response.service}
        assert "tandem.v1.Generation" in names and "grpc.health.v1.Health" in names


def status_of(call) -> grpc.StatusCode:
    with pytest.raises(TandemError) as info:
        call()
    return info.value.code


def test_each_status_code_from_a_real_bad_call(colocated_server):
    """The colocated server has --api-key and --max-queue 3."""
    target = colocated_server.grpc_target
    with TandemClient(target, api_key=API_KEY) as tandem:
        assert status_of(lambda: tandem.complete("x", SamplingParams(top_p=5.0))) == grpc.StatusCode.INVALID_ARGUMENT
        assert status_of(lambda: tandem.complete("x " * 1100)) == grpc.StatusCode.INVALID_ARGUMENT
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        assert status_of(lambda: tandem.complete("x", long, timeout_s=0.05)) == grpc.StatusCode.DEADLINE_EXCEEDED
    with TandemClient(target, api_key=API_KEY, model="no-such-model") as wrong_model:
        assert status_of(lambda: wrong_model.complete("x")) == grpc.StatusCode.NOT_FOUND
    with TandemClient(target, api_key="wrong") as wrong_key:
        assert status_of(lambda: wrong_key.complete("x")) == grpc.StatusCode.UNAUTHENTICATED
        assert status_of(wrong_key.models) == grpc.StatusCode.UNAUTHENTICATED

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        request = pb.GenerationRequest(model=MODEL, text="Count:", params=long.to_proto())
        streams = [stub.Generate(request, metadata=metadata, timeout=120) for _ in range(3)]
        for stream in streams:
            next(stream)  # three in flight: the queue is full
        with pytest.raises(grpc.RpcError) as info:
            next(stub.Generate(request, metadata=metadata, timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        streams[0].cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(streams[0])
        assert info.value.code() == grpc.StatusCode.CANCELLED
        for stream in streams[1:]:
            stream.cancel()


def test_closing_a_stream_cuts_the_request_short_on_the_workers(disagg_server):
    decoded_before = disagg_server.metric("num_generation_tokens", "decode")
    with TandemClient(disagg_server.grpc_target) as tandem:
        stream = tandem.generate("Tell me a long story.", SamplingParams(max_tokens=900, ignore_eos=True))
        received = [next(stream) for _ in range(5)]
        stream.close()  # the caller stops: the request is cancelled on the server
    assert sum(len(c.token_ids) for c in received) == 5
    assert_cut_short(disagg_server, decoded_before, "the stream was closed")


def test_the_sdk_needs_no_torch_ray_or_engine(disagg_server):
    script = textwrap.dedent(f"""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "ray", "engine", "numpy", "transformers"):
                    raise ImportError(f"{{name}} must not be imported by the SDK")
                return None

        sys.meta_path.insert(0, Refuse())
        from client import TandemClient, SamplingParams
        with TandemClient({disagg_server.grpc_target!r}) as tandem:
            done = tandem.complete("[sdk] The sea is", SamplingParams(temperature=0.0, max_tokens=6))
        assert not any(m.split(".")[0] in ("torch", "ray", "engine") for m in sys.modules)
        print(done.choices[0].text)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with TandemClient(disagg_server.grpc_target) as tandem:
        expected = tandem.complete("[sdk] The sea is", SamplingParams(temperature=0.0, max_tokens=6))
    assert result.stdout.strip() == expected.choices[0].text.strip()


def test_tls_on_the_grpc_api(smollm_dir, tmp_path):
    from tests.router.conftest import start_server

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"],
                   check=True, capture_output=True, timeout=60)
    server = start_server(smollm_dir, "colocated", "--grpc-tls-cert", str(cert), "--grpc-tls-key", str(key))
    try:
        target = server.grpc_target.replace("127.0.0.1", "localhost")
        with TandemClient(target, root_certificates=cert.read_bytes()) as tandem:
            assert tandem.complete("[tls] Hi", SamplingParams(max_tokens=2)).usage.completion_tokens == 2
        with TandemClient(target, timeout_s=5, max_retries=0) as plaintext:  # no TLS: refused
            with pytest.raises(TandemError) as info:
                plaintext.complete("[tls] Hi")
            assert info.value.code == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()
