"""Each decode worker's Outputs stream, from the router's side.

A decode worker that streamed one gRPC message per token per request woke both processes once
per token of every stream: at 32 streams, about 30 messages per engine step, each a trip
through gRPC's threads on both sides while the engine's threads wait for the cores. Instead
the router holds one Outputs call per decode worker, and each Generate call names it: the
worker sends every chunk but a request's last on that stream, one message per engine step
for all the requests that name it, and ends each Generate call with the last chunk (finish
reason, errors and stage times keep their call and status codes). The last chunk says how
many chunks went ahead of it on the Outputs stream, because HTTP/2 does not order the
messages of two calls: the attempt waits for them before it hands the last one on.

Where the Outputs stream is lost, every request bound to it fails as from a lost worker
(UNAVAILABLE with no engine scope): the dispatcher moves it to another decode worker, which
resumes from the tokens the client was sent. A worker that does not serve Outputs (an older
one), or whose stream does not open within ``open_timeout_s``, streams on each Generate call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from proto import worker_pb2 as pb

logger = logging.getLogger(__name__)

# how long the last chunk waits for the chunks that went ahead of it on the Outputs stream
# (they left the worker before it, on the same connection: this is only ever a guard)
LAST_CHUNK_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Streamed:
    """A chunk that came on the Outputs stream."""

    chunk: pb.GenerateChunk


@dataclass(frozen=True, slots=True)
class Called:
    """A chunk that came on the Generate call: the last, or every one where the worker did not
    bind the request to the stream."""

    chunk: pb.GenerateChunk


@dataclass(frozen=True, slots=True)
class CallEnded:
    """The Generate call ended with OK."""


@dataclass(frozen=True, slots=True)
class CallFailed:
    error: grpc.aio.AioRpcError


@dataclass(frozen=True, slots=True)
class StreamLost:
    """The Outputs stream ended: chunks on their way may not arrive."""

    why: str


Arrival = Streamed | Called | CallEnded | CallFailed | StreamLost  # one attempt's queue items


def lost(why: str) -> grpc.aio.AioRpcError:
    """The error a lost worker's call ends with: UNAVAILABLE, no engine scope in its metadata."""
    return grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), why)


class WorkerOutputs:
    """One decode worker's Outputs call: hands each step message's chunks to the attempts that
    named their requests. Aio loop only."""

    def __init__(self, address: str, call) -> None:
        self.address = address
        self.stream_id = ""  # the worker's name for it, from its first message
        self.ready: asyncio.Future[bool] = asyncio.get_running_loop().create_future()  # opened, or not
        self.is_closed = False
        self.code: grpc.StatusCode | None = None  # what it ended with (None: open, or it ended OK)
        self._why = ""
        self._call = call
        self._queues: dict[str, asyncio.Queue[Arrival]] = {}  # worker request id -> its attempt's arrivals
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for step in self._call:
                if not self.stream_id:
                    self.stream_id = step.stream_id
                    self.ready.set_result(True)
                for output in step.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:  # else its attempt has gone (cancelled, or failed)
                        queue.put_nowait(Streamed(output.chunk))
            self._why = "it ended"
        except grpc.aio.AioRpcError as exc:
            self.code, self._why = exc.code(), f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            self._why = "the router closed it"
        finally:
            self.is_closed = True
            if not self.ready.done():
                self.ready.set_result(False)
            for queue in self._queues.values():
                queue.put_nowait(StreamLost(self._why))
            if self.stream_id:
                logger.info("Outputs stream from decode worker %s is closed: %s", self.address, self._why)

    async def chunks(self, request_id: str, call) -> AsyncIterator[pb.GenerateChunk]:
        """The chunks of the Generate ``call`` for ``request_id`` (which names this stream), in
        order, from both sources. Raises the call's error, or ``lost`` where this stream ends
        first. Use under ``contextlib.aclosing``: closing it stops reading the call."""
        queue = self._queues[request_id] = asyncio.Queue()
        if self.is_closed:
            queue.put_nowait(StreamLost(self._why))
        reader = asyncio.create_task(_read_call(call, queue))
        num_streamed, last, unbound = 0, None, False
        try:
            while True:
                if last is None:
                    item = await queue.get()
                else:
                    try:
                        item = await asyncio.wait_for(queue.get(), LAST_CHUNK_WAIT_S)
                    except TimeoutError:
                        raise lost(f"{last.num_streamed_chunks - num_streamed} chunks did not come on the "
                                   f"Outputs stream of {self.address}") from None
                match item:
                    case Streamed(chunk):
                        num_streamed += 1
                        yield chunk
                    case Called(chunk) if not chunk.finish_reason:  # not bound there: every chunk comes here
                        unbound = True
                        yield chunk
                    case Called(chunk):
                        last = chunk
                    case CallFailed(error):
                        raise error
                    case StreamLost(why) if not unbound:
                        raise lost(f"the Outputs stream of {self.address} was lost: {why}")
                    case CallEnded() if last is None:  # ended with no last chunk: as the call itself would
                        return
                if last is not None and num_streamed >= last.num_streamed_chunks:
                    yield last
                    return
        finally:
            del self._queues[request_id]
            reader.cancel()

    def close(self) -> None:
        self._call.cancel()


async def _read_call(call, queue: asyncio.Queue[Arrival]) -> None:
    try:
        async for chunk in call:
            queue.put_nowait(Called(chunk))
        queue.put_nowait(CallEnded())
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(CallFailed(exc))


class OutputStreams:
    """The router's Outputs streams, one per decode worker address, opened on first use and
    again after one is lost. Aio loop only."""

    def __init__(self, open_call: Callable[[str], object], open_timeout_s: float = 5.0) -> None:
        self._open_call = open_call  # address -> a new Outputs call to it
        self._open_timeout_s = open_timeout_s
        self._streams: dict[str, WorkerOutputs] = {}  # address -> its latest stream
        self._unsupported: set[str] = set()  # addresses whose worker answered UNIMPLEMENTED

    async def bind(self, address: str, deadline: float | None = None) -> WorkerOutputs | None:
        """The worker's open stream (opened now if need be); None where it has none: its
        requests then stream on their Generate calls. A stream still opening is waited for at
        most the open timeout, and never past ``deadline`` (time.monotonic(): the request's own),
        so that a worker slow to answer costs a request no more than the time it has left."""
        outputs = self._streams.get(address)
        if outputs is None or outputs.is_closed:
            if address in self._unsupported:
                return None
            outputs = self._streams[address] = WorkerOutputs(address, self._open_call(address))
        wait_s = self._open_timeout_s if deadline is None else min(self._open_timeout_s, deadline - time.monotonic())
        try:
            is_open = await asyncio.wait_for(asyncio.shield(outputs.ready), max(0.0, wait_s))
        except TimeoutError:
            return None
        if not is_open and outputs.code == grpc.StatusCode.UNIMPLEMENTED:
            self._unsupported.add(address)
        return outputs if is_open and not outputs.is_closed else None

    def close(self, address: str) -> None:
        outputs = self._streams.pop(address, None)
        if outputs is not None:
            outputs.close()

    def close_all(self) -> None:
        for address in list(self._streams):
            self.close(address)
