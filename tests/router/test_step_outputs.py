"""Tokens in one message per engine step (router/outputs.py, the decode worker's Outputs call),
against a real decode worker in this process over real gRPC: the streams are the tokens of an
unbound run, in order, each request's last chunk on its own call; a step's message carries
several requests; a lost Outputs stream ends its requests on the worker (no KV left behind) and
the router moves them on from the tokens it has; a worker that does not know the stream sends
every chunk on the call."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from contextlib import aclosing

import grpc
import pytest

from engine import SamplingParams
from proto import worker_pb2 as pb
from proto import worker_pb2_grpc as pb_grpc
from proto.convert import params_to_proto
from proto.rpc import CHANNEL_OPTIONS
from router import outputs as router_outputs
from router.dispatch import Dispatcher, Sequence
from router.outputs import WorkerOutputs
from router.policy import RoundRobinPolicy
from router.workers import WorkerPool
from tests.workers import METADATA, SECRET, wait_all_free

PROMPTS = ["The sea is", "Once upon a time", "def fibonacci(n):", "The capital of France"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def decode_worker(smollm_decode_worker):
    return smollm_decode_worker


def reference(llm, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)]


def request(request_id: str, ids: list[int], params: SamplingParams = GREEDY,
            stream_id: str = "") -> pb.GenerateRequest:
    return pb.GenerateRequest(request_id=request_id, prompt_token_ids=ids, params=params_to_proto(params),
                              outputs_stream=stream_id)


async def drain(call) -> list:
    return [chunk async for chunk in call]


async def bound_run(address: str, prompt_ids: list[list[int]], stream_id_of=lambda opened: opened):
    """Opens an Outputs call, then one Generate call per prompt naming ``stream_id_of`` its id;
    returns each request's chunks from the stream, from its call, and the step messages."""
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        outputs = stub.Outputs(pb.OutputsRequest(), metadata=METADATA)
        first = await outputs.read()
        assert first.stream_id and not first.outputs
        streamed, steps = defaultdict(list), []

        async def read_steps():
            while (step := await outputs.read()) is not grpc.aio.EOF:
                steps.append(step)
                for item in step.outputs:
                    streamed[item.request_id].append(item.chunk)

        reader = asyncio.create_task(read_steps())
        calls = [stub.Generate(request(f"r{i}", ids, stream_id=stream_id_of(first.stream_id)), metadata=METADATA,
                               timeout=120) for i, ids in enumerate(prompt_ids)]
        called = await asyncio.gather(*map(drain, calls))
        await asyncio.sleep(0.2)  # the stream's last messages (HTTP/2 does not order two calls)
        outputs.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        return [streamed[f"r{i}"] for i in range(len(prompt_ids))], called, steps


def test_a_step_carries_every_stream_and_the_last_chunk_ends_each_call(decode_worker, llm):
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    streamed, called, steps = asyncio.run(bound_run(decode_worker.address, prompt_ids))
    for ids, chunks, own, expected in zip(prompt_ids, streamed, called, reference(llm, prompt_ids, GREEDY)):
        assert len(own) == 1 and own[0].finish_reason == "length"  # only the last chunk on the call
        assert own[0].num_streamed_chunks == len(chunks) > 0
        assert all(not c.finish_reason for c in chunks)
        assert [t for c in chunks + own for t in c.token_ids] == expected
        assert own[0].num_prompt_tokens == len(ids) and all(c.num_prompt_tokens == len(ids) for c in chunks)
    num_chunks = sum(len(chunks) for chunks in streamed)
    # the four decode in one batch: a step's message carries several of them
    assert len(steps) < num_chunks and max(len(s.outputs) for s in steps) == len(PROMPTS)
    wait_all_free(decode_worker.stats)


def test_a_stream_the_worker_does_not_hold_gets_every_chunk_on_its_call(decode_worker, llm):
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:2]]
    streamed, called, steps = asyncio.run(bound_run(decode_worker.address, prompt_ids, lambda opened: "gone"))
    for chunks, own, expected in zip(streamed, called, reference(llm, prompt_ids, GREEDY)):
        assert chunks == [] and len(own) > 1 and own[-1].num_streamed_chunks == 0
        assert [t for c in own for t in c.token_ids] == expected
    assert steps == []
    wait_all_free(decode_worker.stats)


def test_closing_the_outputs_stream_ends_its_calls_and_frees_their_blocks(decode_worker, llm):
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS[:3]]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def run():
        async with grpc.aio.insecure_channel(decode_worker.address, options=CHANNEL_OPTIONS) as channel:
            stub = pb_grpc.DecodeWorkerStub(channel)
            outputs = stub.Outputs(pb.OutputsRequest(), metadata=METADATA)
            stream_id = (await outputs.read()).stream_id
            calls = [stub.Generate(request(f"c{i}", ids, long, stream_id), metadata=METADATA, timeout=120)
                     for i, ids in enumerate(prompt_ids)]
            while not (await outputs.read()).outputs:  # they are decoding
                pass
            outputs.cancel()
            return await asyncio.gather(*map(drain, calls), return_exceptions=True)

    results = asyncio.run(run())
    for result in results:
        assert isinstance(result, grpc.aio.AioRpcError) and result.code() == grpc.StatusCode.UNAVAILABLE, result
        assert "Outputs stream" in result.details()
    wait_all_free(decode_worker.stats)


def sequences(prompt_ids: list[list[int]], params: SamplingParams) -> list[Sequence]:
    return [Sequence(i, i, request(f"seq{i}", ids, params)) for i, ids in enumerate(prompt_ids)]


async def dispatch(pool: WorkerPool, seqs: list[Sequence], on_chunk=None) -> tuple[list[list[int]], list[str]]:
    tokens, decisions = [[] for _ in seqs], []
    dispatcher = Dispatcher(pool, pb.KV_TRANSPORT_GRPC, on_decision=decisions.append)
    try:
        async for item in dispatcher.merged(seqs):
            assert not hasattr(item, "error"), item
            tokens[item.sequence.index] += item.chunk.token_ids
            if on_chunk is not None:
                on_chunk(item.sequence.index, len(tokens[item.sequence.index]))
    finally:
        await pool.stop()
    return tokens, decisions


def healthy_pool(address: str, step_outputs: bool = True) -> WorkerPool:
    pool = WorkerPool([address], [], SECRET, RoundRobinPolicy(), step_outputs=step_outputs)
    pool.decode[0].healthy = True  # as if its last Stats had answered
    return pool


def test_the_router_reads_one_stream_per_worker_and_moves_on_when_it_is_lost(decode_worker, llm):
    prompt_ids = [llm.get_tokenizer().encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = reference(llm, prompt_ids, params)
    unbound = healthy_pool(decode_worker.address, step_outputs=False)
    assert asyncio.run(dispatch(unbound, sequences(prompt_ids, params)))[0] == expected

    async def lost_midway():
        pool = healthy_pool(decode_worker.address)
        opened = []

        def on_chunk(index: int, count: int) -> None:
            outputs = pool.outputs._streams[decode_worker.address]
            opened.append(outputs)
            if index == 0 and count == 8 and len(set(opened)) == 1:
                outputs.close()  # the stream is lost; the worker itself still answers
                # its next Stats brings it back into routing (mark_unreachable took it out)
                asyncio.get_running_loop().call_later(0.3, setattr, pool.decode[0], "healthy", True)

        tokens, decisions = await dispatch(pool, sequences(prompt_ids, params), on_chunk)
        return tokens, decisions, len(set(opened))

    tokens, decisions, num_streams = asyncio.run(lost_midway())
    assert tokens == expected  # no token twice, none missing
    assert num_streams == 2 and 1 <= decisions.count("migrate") <= len(PROMPTS)
    wait_all_free(decode_worker.stats)


class _Call:
    """A stand-in for a streaming gRPC call: yields what the test feeds it."""

    def __init__(self) -> None:
        self.items: asyncio.Queue = asyncio.Queue()

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = await self.items.get()
        if item is None:
            raise StopAsyncIteration
        return item

    def cancel(self) -> None:
        self.items.put_nowait(None)


def chunk(token: int, finish: str = "", num_streamed: int = 0) -> pb.GenerateChunk:
    return pb.GenerateChunk(token_ids=[token], finish_reason=finish, num_streamed_chunks=num_streamed)


def step(request_id: str, *tokens: int) -> pb.StepOutputs:
    return pb.StepOutputs(outputs=[pb.SequenceOutput(request_id=request_id, chunk=chunk(t)) for t in tokens])


def test_the_last_chunk_waits_for_those_still_on_the_stream(monkeypatch):
    async def run():
        stream, call = _Call(), _Call()
        outputs = WorkerOutputs("w:1", stream)
        stream.items.put_nowait(pb.StepOutputs(stream_id="s"))
        assert await outputs.ready
        received = []
        async with aclosing(outputs.chunks("a", call)) as chunks:
            stream.items.put_nowait(step("a", 1))
            call.items.put_nowait(chunk(3, "length", num_streamed=2))  # overtakes the stream's second
            call.items.put_nowait(None)
            received.append(await anext(chunks))
            await asyncio.sleep(0.05)
            stream.items.put_nowait(step("b", 9))  # another request's: not this one's
            stream.items.put_nowait(step("a", 2))
            received += [c async for c in chunks]
        assert [c.token_ids[0] for c in received] == [1, 2, 3]
        assert received[-1].finish_reason == "length"

        monkeypatch.setattr(router_outputs, "LAST_CHUNK_WAIT_S", 0.1)
        call = _Call()
        call.items.put_nowait(chunk(3, "length", num_streamed=1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with aclosing(outputs.chunks("c", call)) as chunks:
                [c async for c in chunks]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # as a lost worker: the router moves it
        stream.cancel()

    asyncio.run(run())


def test_tokens_on_the_outputs_stream_count_as_progress_against_the_stall_timeout(smollm_dir, llm):
    from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from engine.llm import EngineArgs
    from worker_runtime.server import ServerConfig

    engine = EngineArgs(model=str(smollm_dir), dtype="float32", num_kv_blocks=64, max_model_len=512, num_threads=1)
    worker = DecodeWorker(DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET), stall_timeout_s=0.5))
    worker.start()
    try:
        prompt_ids = [llm.get_tokenizer().encode(PROMPTS[0])]
        params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

        async def run():
            seqs = sequences(prompt_ids, params)
            started = asyncio.get_running_loop().time()
            tokens, decisions = await dispatch(healthy_pool(worker.address), seqs)
            return tokens, decisions, asyncio.get_running_loop().time() - started

        # the Generate call itself sees only the last chunk, well after the stall timeout
        tokens, decisions, elapsed = asyncio.run(run())
        assert elapsed > 1.0, "the stream must outlast the stall timeout for this test to say anything"
        assert tokens == reference(llm, prompt_ids, params) and "migrate" not in decisions
    finally:
        worker.stop()


def test_a_stream_still_opening_is_waited_for_no_longer_than_the_request_has():
    """A worker that does not answer the Outputs call costs a request at most its own time
    left, not the open timeout; a later request with time to spare still gets the stream once
    it opens."""
    async def run():
        opened = []

        def open_call(address):
            opened.append(_Call())
            return opened[-1]

        streams = router_outputs.OutputStreams(open_call, open_timeout_s=60.0)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await streams.bind("w:1", deadline=time.monotonic() + 0.2) is None
        assert loop.time() - started < 30.0  # the request's 0.2 s, far below the 60 s open timeout
        assert await streams.bind("w:1", deadline=time.monotonic() - 1.0) is None  # already past it
        assert len(opened) == 1  # the same stream, still opening: not opened again
        later = asyncio.create_task(streams.bind("w:1", deadline=time.monotonic() + 60.0))
        await asyncio.sleep(0.05)
        opened[0].items.put_nowait(pb.StepOutputs(stream_id="s1"))
        bound = await later
        assert bound is not None and bound.stream_id == "s1"
        streams.close_all()

    asyncio.run(run())


# The same against a live gRPC server holding its Outputs call unopened, in a process of its own
# (a grpc.aio server and channel on a loop of their own, gone with the process).
LIVE_BIND = """
import asyncio, time
import grpc
from proto import worker_pb2 as pb, worker_pb2_grpc as pb_grpc
from proto.rpc import CHANNEL_OPTIONS
from router import outputs as router_outputs

class Slow(pb_grpc.DecodeWorkerServicer):
    def __init__(self):
        self.go = asyncio.Event()

    async def Outputs(self, request, context):
        await self.go.wait()
        yield pb.StepOutputs(stream_id="live")
        await asyncio.Event().wait()  # open until the router closes it

async def run():
    server, servicer = grpc.aio.server(), Slow()
    pb_grpc.add_DecodeWorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        stub = pb_grpc.DecodeWorkerStub(channel)
        streams = router_outputs.OutputStreams(lambda address: stub.Outputs(pb.OutputsRequest()), open_timeout_s=60.0)
        started = time.monotonic()
        first = await streams.bind("live", deadline=time.monotonic() + 0.3)
        waited = time.monotonic() - started
        servicer.go.set()
        second = await streams.bind("live", deadline=time.monotonic() + 60.0)
        print("first", first is None, "waited", round(waited, 3), "second", second and second.stream_id)
        streams.close_all()
    await server.stop(None)

asyncio.run(run())
"""


def test_a_worker_that_holds_its_outputs_stream_unopened_costs_a_request_only_its_deadline():
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", LIVE_BIND], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    assert words[:2] == ["first", "True"]  # nothing bound within the request's 0.3 s...
    assert float(words[3]) < 30.0  # ...and it waited about that, not the 60 s open timeout
    assert words[4:] == ["second", "live"]  # a later request gets the stream once the worker opens it
