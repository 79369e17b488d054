"""The gateway in this process (uvicorn on a thread, real HTTP) in front of decode workers in
this process (real gRPC): what happens when workers die or are missing."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
import uvicorn

from bench.launch import free_port
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.llm import EngineArgs
from engine.model_info import load_model_info
from router.app import build_app
from router.policy import RoundRobinPolicy
from router.state import RouterConfig, RouterState
from router.workers import WorkerPool
from tests.workers import SECRET, wait_until
from worker_runtime.server import ServerConfig


class Gateway:
    def __init__(self, model_dir, decode_addresses: list[str], tracing=None, **config) -> None:
        self.pool = WorkerPool(decode_addresses, [], SECRET, RoundRobinPolicy(), poll_interval_s=0.2)
        self.pool.failures_to_drop = 1
        state = RouterState(RouterConfig("tiny", 512, **config), load_model_info(str(model_dir)), self.pool,
                            tracing=tracing)
        self.state = state
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(build_app(state), host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        await self.pool.start()
        await self.server.serve()
        await self.pool.stop()

    def __enter__(self) -> "Gateway":
        self._thread.start()
        wait_until(lambda: self.server.started, what="the gateway to start")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)


def start_decode_worker(model_dir, tracing=None) -> DecodeWorker:
    engine = EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=128, max_model_len=512, num_threads=1)
    worker = DecodeWorker(DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET), tracing=tracing))
    worker.start()
    return worker


@pytest.mark.parametrize("migration_limit", [0, 3])
def test_worker_dying_mid_stream_ends_the_stream_with_an_error_event(tiny_llama_dir, migration_limit):
    """Its only decode worker gone for good: with migration off the stream ends at once with the
    worker's error; with it on, the stream waits for a worker within --request-timeout (3 s
    here), then ends with a 503 (none came back)."""
    worker = start_decode_worker(tiny_llama_dir)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with Gateway(tiny_llama_dir, [worker.address], migration_limit=migration_limit,
                     request_timeout_s=3.0) as gateway:
            wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, what="ready")
            with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=60) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["text"] is not None
                # the decode worker dies while the stream runs: no grace for its streams, which
                # on a fast CPU would finish all 400 tokens within the default second
                worker.runtime.server.stop(grace_s=0)
                events = [line[6:] for line in lines if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            if migration_limit:
                assert error["code"] == 503 and "no healthy worker" in error["message"], error
            else:
                assert error["code"] >= 500 and "worker error" in error["message"], error
            # with its only worker gone the gateway is not ready and says so
            wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 503, what="not ready")
            refused = httpx.post(f"{gateway.url}/v1/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 503 and "no healthy worker" in refused.json()["error"]["message"]
    finally:
        worker.stop()


def test_colocated_trace_with_content_over_grpc_otlp(tiny_llama_dir):
    """--trace-content puts the prompt and output text on the request span; a prompt prefilled
    on the decode worker has prefill_queue, prefill and decode spans there (gRPC OTLP)."""
    from telemetry.tracing import ROUTER_SERVICE, Tracing, TracingConfig
    from tests.otlp import GrpcOTLPReceiver

    receiver = GrpcOTLPReceiver()
    worker = start_decode_worker(tiny_llama_dir, TracingConfig(receiver.endpoint, "grpc"))
    tracing = Tracing(ROUTER_SERVICE, TracingConfig(receiver.endpoint, "grpc", trace_content=True))
    try:
        with Gateway(tiny_llama_dir, [worker.address], tracing) as gateway:
            wait_until(lambda: gateway.pool.is_ready, what="the worker to be polled")
            answer = httpx.post(f"{gateway.url}/v1/completions", headers={"X-Request-Id": "content-1"}, timeout=60,
                                json={"model": "tiny", "prompt": "hello world", "max_tokens": 6, "ignore_eos": True,
                                      "temperature": 0}).json()
            tracing.flush()
            worker.runtime.tracing.flush()

            def whole(r):
                roots = [s for s in r.spans if s.attributes.get("tandem.request_id") == "content-1"
                         and not s.parent_span_id]
                spans = r.trace(roots[0].trace_id) if roots else []
                return (roots[0], spans) if {"decode", "stream"} <= {s.name for s in spans} else None
            root, spans = receiver.wait_for(whole, what="the request's trace")
    finally:
        worker.stop()
        tracing.shutdown()
        receiver.stop()
    assert root.name == "text_completion tiny"
    stages = sorted((s.name, s.service) for s in spans if s is not root)
    assert stages == [("decode", "tandem-decode"), ("prefill", "tandem-decode"), ("prefill_queue", "tandem-decode"),
                      ("route", "tandem-router"), ("stream", "tandem-router"), ("tokenize", "tandem-router")]
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    assert json.loads(root.attributes["gen_ai.input.messages"])[0]["parts"][0]["content"] == "hello world"
    output = json.loads(root.attributes["gen_ai.output.messages"])[0]
    assert output["parts"][0]["content"] == answer["choices"][0]["text"] and output["finish_reason"] == "length"
    assert root.attributes["tandem.kv_bytes"] == 0 and root.attributes["tandem.prefill_workers"] == []


def test_tokenizing_runs_in_its_pool_and_never_blocks_the_event_loop(tiny_llama_dir):
    """A prompt whose tokenizing hangs (held here until released) holds neither /health nor
    another request's tokenizing: both answer while it is stuck, from the tokenizer pool."""
    worker = start_decode_worker(tiny_llama_dir)
    entered, release, threads = threading.Event(), threading.Event(), []
    try:
        with Gateway(tiny_llama_dir, [worker.address]) as gateway:
            wait_until(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, what="ready")
            tokenizer = gateway.state.tokenizer
            real_encode = tokenizer.encode

            def encode(text, add_special_tokens=True):
                threads.append(threading.current_thread().name)
                if text == "stuck":
                    entered.set()
                    assert release.wait(60)
                return real_encode(text, add_special_tokens)

            tokenizer.encode = encode
            body = {"model": "tiny", "prompt": "stuck", "max_tokens": 2}
            stuck = threading.Thread(target=lambda: httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=90))
            stuck.start()
            assert entered.wait(30)
            assert httpx.get(f"{gateway.url}/health", timeout=10).status_code == 200
            other = httpx.post(f"{gateway.url}/tokenize", json={"prompt": "free"}, timeout=10)
            assert other.status_code == 200 and other.json()["count"] > 0
            assert not release.is_set() and stuck.is_alive()  # both answered while it was stuck
            release.set()
            stuck.join(60)
            assert threads and all(name.startswith("tokenize") for name in threads), threads
    finally:
        release.set()
        worker.stop()
