"""Running a request's sequences on the workers.

One HTTP request becomes one or more sequences (prompts x n); each is a Generate stream on a
decode worker (with a prefill worker as its KV source in disaggregated mode). A sequence
that fails before its first token is retried once on another worker pair; one whose decode
worker is lost after it moves (at most ``migration_limit`` times) to another decode worker,
or to the restarted one, which prefills the prompt and the tokens already sent and streams
on from there: the client sees one stream, no token twice and none missing. Cancelling a
sequence (client gone, drain deadline) cancels its gRPC call, and the decode worker then
cancels its prefill: nothing stays behind on any worker."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from engine.kv_cache.block_hash import hash_blocks
from engine.request import ErrorScope
from prefix_index.reader import PrefixIndex
from proto import worker_pb2 as pb
from proto.rpc import ERROR_PARAM_KEY, ERROR_SCOPE_KEY
from router.errors import APIError
from router.policy import RouteRequest
from router.recent_routes import RecentRoutes
from router.request_trace import SequenceTrace
from router.workers import Assignment, WorkerPool, WorkerView

_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
              grpc.StatusCode.DEADLINE_EXCEEDED}
_LOST = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}  # with no engine scope
# how long a retry may wait for a restarted worker where the failed one was its role's only one
# (Ray restarted a SIGKILLed decode worker and the router found it in ~8 s here); bounded by the
# request's own deadline too
RETRY_WAIT_S = 30.0
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
                grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504}


@dataclass(frozen=True, slots=True)
class Sequence:
    index: int  # choice index in the response
    prompt_index: int  # which prompt of the request
    request: pb.GenerateRequest  # prompt, params, request id; the prefill target is set per attempt
    trace: SequenceTrace | None = None  # its route and workers (stage metrics, trace spans)
    deadline: float | None = None  # time.monotonic() of its request's --request-timeout (None: from its dispatch)
    route: RouteRequest | None = None  # the prefix index's answer, when admission just asked it (else looked up here)


@dataclass(slots=True)
class _Moves:
    """One sequence's attempts so far."""

    deadline: float  # time.monotonic() of its --request-timeout, over all its attempts
    tried: set[str] = field(default_factory=set)  # the workers that failed it
    sent: list[int] = field(default_factory=list)  # token ids handed on: a migration resumes after them
    started: bool = False  # a chunk was handed on
    retried: bool = False  # failed once before its first token (retried once, at most)
    migrations: int = 0  # moved to another decode worker after its first token


@dataclass(frozen=True, slots=True)
class SequenceChunk:
    sequence: Sequence
    chunk: pb.GenerateChunk


@dataclass(frozen=True, slots=True)
class SequenceFailed:
    sequence: Sequence
    error: APIError


def _scope(exc: grpc.aio.AioRpcError) -> str | None:
    """The engine's ErrorScope value a worker sent with its error; None: the error did not
    come from a worker's engine (the worker could not be reached, or its server failed)."""
    return dict(exc.trailing_metadata() or ()).get(ERROR_SCOPE_KEY)


def _is_own_fault(exc: grpc.aio.AioRpcError) -> bool:
    """The request failed for a reason of its own (the engine says so): another worker
    would fail it the same way, so it is not retried."""
    return _scope(exc) == ErrorScope.REQUEST.value


def _is_lost(exc: grpc.aio.AioRpcError) -> bool:
    """The worker did not answer: its process, its connection or its node is gone."""
    return exc.code() in _LOST and _scope(exc) is None


def api_error(exc: grpc.aio.AioRpcError) -> APIError:
    param = dict(exc.trailing_metadata() or ()).get(ERROR_PARAM_KEY)
    return APIError(_HTTP_STATUS.get(exc.code(), 500), f"worker error ({exc.code().name}): {exc.details()}", param)


class Dispatcher:
    def __init__(self, pool: WorkerPool, kv_transport: int, local_prefill_max_tokens: int = 0,
                 index: PrefixIndex | None = None, on_decision: Callable[[str], None] = lambda decision: None,
                 request_timeout_s: float = 600.0, migration_limit: int = 3) -> None:
        self.pool = pool
        self.request_timeout_s = request_timeout_s  # a sequence's deadline, over all its attempts
        # how often a sequence may move to another decode worker after its first token
        self.migration_limit = migration_limit
        # "remote" | "local" | "local_fallback" (no prefill worker) | "retry" | "migrate" | "fallback" (no index answer)
        self._on_decision = on_decision
        self.index = index  # None: no prefix index (route by load)
        self.recent = RecentRoutes()  # prefixes on their way to workers, not yet in the index
        self.kv_transport = kv_transport
        # a prompt this short costs less to prefill on the decode worker than to transfer
        self.local_prefill_max_tokens = local_prefill_max_tokens
        self.active: dict[str, str] = {}  # worker request id -> decode worker address (for drain aborts)

    async def stream(self, sequence: Sequence) -> AsyncIterator[pb.GenerateChunk]:
        moves = _Moves(sequence.deadline or time.monotonic() + self.request_timeout_s)
        trace = sequence.trace or SequenceTrace()
        trace.route_started = time.monotonic()
        route = sequence.route or await self.route(sequence.request)
        if self.index is not None and route.hits is None:
            self._on_decision("fallback")  # the index did not answer: routed by load
        while True:
            assignment = self.pool.assign(frozenset(moves.tried), route)
            if assignment is None and (moves.retried or moves.migrations):  # the failed one was its role's only one:
                # its restart may serve (or, after a migration, the same worker once it answers again)
                assignment = await self._await_worker(frozenset(moves.tried), route,
                                                      min(moves.deadline, time.monotonic() + RETRY_WAIT_S))
            if assignment is None:
                raise APIError(503, "no healthy worker is available; try again shortly",
                               headers={"Retry-After": "1"})
            if trace.route_ended is None:
                trace.route_ended = time.monotonic()
            chosen = [assignment.decode.address] + ([assignment.prefill.address] if assignment.prefill else [])
            self.recent.remember(list(route.digests), chosen)
            try:
                async for chunk in self._attempt(sequence, assignment, route, trace, moves):
                    moves.started = True
                    moves.sent.extend(chunk.token_ids)  # handed on: a migration resumes after it
                    yield chunk
                return
            except grpc.aio.AioRpcError as exc:
                self._next_move(exc, assignment, moves)

    def _next_move(self, exc: grpc.aio.AioRpcError, assignment: Assignment, moves: _Moves) -> None:
        """After a failed attempt: record the next move (a retry before the first token, a
        migration after it), or raise the error the client gets."""
        if time.monotonic() >= moves.deadline:
            raise APIError(504, f"the request did not finish within --request-timeout "
                                f"({self.request_timeout_s:g} s)") from None
        failed = self._failed_worker(exc, assignment)
        if exc.code() not in _RETRYABLE or _is_own_fault(exc):
            raise api_error(exc) from None
        if moves.started:
            # only a worker that is gone (no answer from it) loses its streams to others: one whose
            # engine reported a failure may have failed on this very sequence, which would take
            # the next worker down too
            if moves.migrations >= self.migration_limit or not _is_lost(exc):
                raise api_error(exc) from None
            moves.migrations += 1
            self._on_decision("migrate")
            # out of routing until its Stats answer again: a restarted one has a new address, and
            # one that was only unreachable for a while (stopped, partitioned) may take it back
            self.pool.mark_unreachable(failed, exc.details())
            return
        if moves.retried:
            raise api_error(exc) from None
        moves.retried = True
        self._on_decision("retry")
        if failed.healthy:  # only that one sits the next attempt out: the other worker of the pair may serve it
            moves.tried.add(failed.address)
        # one the call could not reach is out of routing until its Stats answer again: then it may
        # serve the retry (a partition that healed), as may its restart at a new address

    async def _await_worker(self, exclude: frozenset[str], route: RouteRequest, until: float) -> Assignment | None:
        """A pair once one serves (a restarted incarnation has a new address), or None at ``until``."""
        while time.monotonic() < until:
            await asyncio.sleep(0.1)
            assignment = self.pool.assign(exclude, route)
            if assignment is not None:
                return assignment
        return None

    def _failed_worker(self, exc: grpc.aio.AioRpcError, assignment: Assignment) -> WorkerView:
        """Which worker a failure before the first token was: the prefill worker where the
        decode worker says its KV transfer failed, else the decode worker, which leaves
        routing at once where the call did not reach it (no answer from its server)."""
        if assignment.prefill is not None and _scope(exc) == ErrorScope.KV_TRANSFER.value:
            return assignment.prefill
        if exc.code() == grpc.StatusCode.UNAVAILABLE and _scope(exc) is None:
            self.pool.mark_unreachable(assignment.decode, exc.details())
        return assignment.decode

    async def route(self, request: pb.GenerateRequest) -> RouteRequest:
        """What the prefix index says about this prompt: each worker's leading cached tokens."""
        num_prompt = len(request.prompt_token_ids)
        workers = self.pool.decode + self.pool.prefill
        reference = next((w.stats for w in workers if w.stats is not None and w.stats.prefix_incarnation), None)
        if self.index is None or reference is None:
            return RouteRequest(num_prompt)
        salt = (request.cache_salt,) if request.cache_salt else ()
        digests = hash_blocks(reference.prefix_namespace, list(request.prompt_token_ids), reference.block_size, salt)
        incarnations = {w.address: w.stats.prefix_incarnation if w.stats is not None else "" for w in workers}
        held = await self.index.leading_blocks(reference.prefix_namespace, digests, incarnations)
        if held is None:
            return RouteRequest(num_prompt, None, tuple(digests))
        recent = self.recent.leading_blocks(digests, [w.address for w in workers])
        hits = {address: max(n, recent[address]) * reference.block_size for address, n in held.items()}
        indexed = {address: n * reference.block_size for address, n in held.items()}
        return RouteRequest(num_prompt, hits, tuple(digests), indexed)

    async def _attempt(self, sequence: Sequence, assignment: Assignment, route: RouteRequest,
                       trace: SequenceTrace, moves: _Moves) -> AsyncIterator[pb.GenerateChunk]:
        request = self._attempt_request(sequence, moves)
        decode, prefill = assignment.decode, assignment.prefill
        num_prompt = len(request.prompt_token_ids)
        # what the decode worker lacks, by what it really holds (not by what is on its way there)
        missing = num_prompt - (route.indexed_hits or {}).get(decode.address, 0)
        if moves.started or missing <= self.local_prefill_max_tokens or request.params.HasField("prompt_logprobs"):
            prefill = None  # resumed, short, or needs prompt logprobs (computed only where the prompt is prefilled)
        if not moves.started:
            self._on_decision("local_fallback" if assignment.prefill_lost else "local" if prefill is None
                              else "remote")
        trace.attempts += 1
        trace.decode, trace.prefill = decode.address, prefill.address if prefill else None
        # whichever worker prefills it has these prompt tokens to compute (prediction, load routing)
        prefiller, num_queued = (prefill, num_prompt) if prefill is not None else (decode, max(0, missing))
        if prefill is not None:
            request.prefill.address = prefill.address
            request.prefill.transport = self.kv_transport
            prefill.in_flight += 1
        prefiller.prompt_tokens_in_flight += num_queued
        decode.in_flight += 1
        self.active[request.request_id] = decode.address
        prefilling, call, chunks = True, None, None
        try:
            outputs = (await self.pool.outputs.bind(decode.address, moves.deadline) if self.pool.outputs is not None
                       else None)
            if outputs is not None:  # its chunks come on the worker's Outputs stream, one message per step
                request.outputs_stream = outputs.stream_id
            call = self.pool.decode_stub(decode).Generate(request, metadata=self.pool.metadata + trace.metadata,
                                                          timeout=max(0.001, moves.deadline - time.monotonic()))
            chunks = call if outputs is None else outputs.chunks(request.request_id, call)
            async for chunk in chunks:
                if prefilling and chunk.token_ids:  # the first token: its prompt is done
                    prefilling = False
                    self._prefilled(prefill, prefiller, num_queued)
                if moves.started:
                    chunk.num_cached_tokens = 0  # the usage's cached tokens are the first worker's
                yield chunk
        finally:
            if chunks is not None and chunks is not call:  # stops reading the call and the stream for it
                await chunks.aclose()
            if call is not None:
                call.cancel()  # no-op when it completed; otherwise the workers drop the request
            decode.in_flight -= 1
            self.active.pop(request.request_id, None)
            if prefilling:
                self._prefilled(prefill, prefiller, num_queued)

    @staticmethod
    def _prefilled(prefill: WorkerView | None, prefiller: WorkerView, num_queued: int) -> None:
        """The attempt's prompt is no longer queued where it was prefilled."""
        if prefill is not None:
            prefill.in_flight -= 1
        prefiller.prompt_tokens_in_flight -= num_queued

    @staticmethod
    def _attempt_request(sequence: Sequence, moves: _Moves) -> pb.GenerateRequest:
        request = pb.GenerateRequest()
        request.CopyFrom(sequence.request)
        # unique per attempt on the workers: clients may reuse ids, and a stale stream of an
        # earlier attempt (or request) must never meet this one (as vLLM, a random suffix)
        request.request_id = f"{sequence.request.request_id}-{secrets.token_hex(4)}"
        if moves.started:  # a migration: the new decode worker prefills prompt + sent tokens and goes on
            request.resume_token_ids[:] = moves.sent
            request.params.ClearField("prompt_logprobs")  # sent with the first token
        return request

    async def merged(self, sequences: list[Sequence]) -> AsyncIterator[SequenceChunk | SequenceFailed]:
        """All sequences at once, chunks in arrival order. Closing the iterator cancels them."""
        if len(sequences) == 1:  # the common case: no queue, no task, one hop less per token
            try:
                async for chunk in self.stream(sequences[0]):
                    yield SequenceChunk(sequences[0], chunk)
            except APIError as exc:
                yield SequenceFailed(sequences[0], exc)
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(sequence: Sequence) -> None:
            try:
                async for chunk in self.stream(sequence):
                    queue.put_nowait(SequenceChunk(sequence, chunk))
            except APIError as exc:
                queue.put_nowait(SequenceFailed(sequence, exc))
            finally:
                queue.put_nowait(done)

        tasks = [asyncio.create_task(pump(s)) for s in sequences]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is done:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def abort_all(self) -> None:
        """Drain deadline: ask every decode worker to abort what this router has running
        there; their streams then end with finish_reason "abort"."""
        calls = []
        for request_id, address in list(self.active.items()):
            worker = next((w for w in self.pool.decode if w.address == address), None)
            if worker is not None:
                calls.append(self.pool.decode_stub(worker).Abort(
                    pb.AbortRequest(request_id=request_id), metadata=self.pool.metadata, timeout=5))
        await asyncio.gather(*calls, return_exceptions=True)
