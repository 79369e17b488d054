"""EngineLoop: one EngineCore built and stepped on its own thread, for workers that serve it
from other threads (gRPC handlers, transport receivers).

The core is single-threaded. Other threads reach it in exactly three ways, each a Future of
what the engine thread did between two steps: ``add`` (an ``AddRequest``: made, validated and
queued or, for remote KV, its blocks reserved), ``abort``, and the output listener a request
was added with, which is called (on the engine thread) with each of its outputs. Listeners
must only hand the output over; ``after_outputs`` runs once after each
batch of them (a step's, an abort's), so that a listener can queue and the hook hand the whole
batch to another thread with one wake-up.

The engine thread also builds the core (model load, weight packing, warm-up), so that it is
the only thread of the process that runs OpenMP parallel regions of more than one thread (the
prefill lane's thread runs its own on one: engine/prefill_lane.py). Each thread that starts one
gets a team of OpenMP threads of its own, and once a process's OpenMP threads outnumber its
CPUs, libgomp cuts the spin-wait of every team's barrier to about a hundred spins: its threads
then sleep and wake at each of the step's few hundred parallel regions. A model loaded on the
main thread and stepped on this one made oneDNN's bfloat16 matmul run at single-thread speed
and the decode step 1.5-2x slower on 2 cores (docs/benchmarks.md, "The serving path").
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from engine.engine_core import EngineCore, EngineCoreOutput, ErrorScope
from engine.llm import EngineArgs
from engine.platform import name_native_thread
from engine.remote_kv import KVExport, KVFailurePolicy
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

OutputListener = Callable[[EngineCoreOutput], None]
# Between steps, before scheduling: work that produces outputs off the step (remote KV
# landing). Runs on the engine thread.
BeforeStep = Callable[[EngineCore], list[EngineCoreOutput]]


@dataclass(frozen=True)
class RemoteKV:
    """Decode role: reserve the prompt's blocks and wait at most ``deadline_s`` for its KV from
    a prefill worker, then ``policy`` applies. With no free blocks now the request is prefilled
    here instead, or, under the fail policy, refused (NoFreeBlocks)."""

    deadline_s: float
    policy: KVFailurePolicy


@dataclass(frozen=True)
class AddRequest:
    """One request for the engine thread to make (validate) and add. Its outputs go to
    ``listener`` until one finishes it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    listener: OutputListener
    cache_salt: str | None = None
    arrival_time: float | None = None  # time.monotonic() its queue time starts at (default: now)
    kv_export: KVExport | None = None  # prefill role: where its prompt's KV goes, layer by layer
    remote_kv: RemoteKV | None = None  # decode role: its KV comes from a prefill worker
    resume_token_ids: tuple[int, ...] = ()  # a migrated sequence's tokens already sent (engine_core.make_request)
    priority: int = 0  # the priority policy runs lower values first (engine/request_queue.py)


@dataclass(frozen=True)
class Added:
    """What ``add`` decided for a request."""

    seed: int  # the sampling seed (the request's, or drawn here)
    num_prompt_tokens: int
    kv_from_pos: int | None  # remote KV: blocks reserved, the sender starts at this position; None: computed here


class EngineLoopStopped(RuntimeError):
    """The engine loop is not running (stopped, or died): nothing can be added."""


class NoFreeBlocks(Exception):
    """Remote KV under the fail policy found no free KV blocks (the client is told so)."""


def build_engine(args: EngineArgs) -> EngineCore:
    """A worker's core, warmed up: kernels compiled (on a GPU) before the worker says it is ready."""
    core = args.build_core()
    core.warm_up()
    return core


class EngineLoop:
    """``EngineLoop(build)`` starts the engine thread, which calls ``build()`` for the core and
    waits for ``start()``; the constructor returns once the core is built (``self.core``) and
    raises what ``build`` raised, or RuntimeError after ``build_timeout_s``."""

    def __init__(self, build: Callable[[], EngineCore], before_step: BeforeStep | None = None,
                 idle_poll_s: float = 0.005, after_step: Callable[[EngineCore], None] | None = None,
                 after_outputs: Callable[[], None] | None = None, build_timeout_s: float = 1800.0,
                 on_death: Callable[[BaseException], None] | None = None):
        self._before_step = before_step
        self._after_step = after_step  # e.g. publish the step's prefix-cache events
        self._after_outputs = after_outputs  # e.g. wake the thread the listeners queued for
        self._on_death = on_death  # the loop died (after its requests got their errors): e.g. stop serving
        self._idle_poll_s = idle_poll_s  # how often an idle loop looks at remote-KV deadlines
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, OutputListener] = {}
        self._wake = threading.Event()
        self._stopping = False
        self.error: BaseException | None = None  # what stopped the loop, if it died
        self._built = threading.Event()
        self._go = threading.Event()  # start() or stop() was called
        self._build_error: BaseException | None = None
        self.core: EngineCore | None = None
        self._thread = threading.Thread(target=self._main, args=(build,), name="engine-loop", daemon=True)
        self._thread.start()
        if not self._built.wait(build_timeout_s):
            self._stopping = True
            self._go.set()
            raise RuntimeError(f"the engine was not built within {build_timeout_s:.0f} s")
        if self._build_error is not None:
            raise self._build_error
        if self.core.lane is not None:
            self.core.lane.on_done = self.wake  # a prompt it finished joins the batch at once

    def start(self) -> None:
        """Start stepping (the core is built already)."""
        self._go.set()

    def wake(self) -> None:
        self._wake.set()

    def add(self, add: AddRequest) -> Future:
        """Make and add a request before the next step. The Future's result: ``Added``; its
        exception: the request's validation error (InvalidParam, a ValueError), NoFreeBlocks,
        or EngineLoopStopped when the loop is not running."""
        return self._submit(self._add, add)

    def abort(self, request_id: str) -> Future:
        """Abort a request wherever it is; its listener gets the final ABORT output.
        The Future's result: whether the request was still here."""
        return self._submit(self._abort, request_id)

    def _submit(self, fn: Callable, arg) -> Future:
        future: Future = Future()
        if self._stopping or self.error is not None:
            future.set_exception(EngineLoopStopped("the engine loop is not running"))
            return future
        self._calls.put((future, fn, arg))
        self._wake.set()
        return future

    def _add(self, add: AddRequest) -> Added:  # engine thread
        core = self.core
        request = core.make_request(add.request_id, add.prompt_token_ids, add.params, add.cache_salt,
                                    add.resume_token_ids, add.priority)
        if add.arrival_time is not None:
            request.arrival_time = add.arrival_time
        kv_from_pos = None
        if add.remote_kv is not None:
            kv_from_pos = core.add_remote_request(request, add.remote_kv.deadline_s, add.remote_kv.policy)
            if kv_from_pos is None and add.remote_kv.policy is KVFailurePolicy.FAIL:
                raise NoFreeBlocks(f"no free KV blocks for a {request.num_prompt_tokens}-token prompt now")
        if kv_from_pos is None:
            core.add_request(request, add.kv_export)  # queued here like any colocated request
        self._listeners[add.request_id] = add.listener
        return Added(request.seed, request.num_prompt_tokens, kv_from_pos)

    def _abort(self, request_id: str) -> bool:
        output = self.core.abort_request(request_id)
        if output is None:
            self._listeners.pop(request_id, None)
            return False
        self._dispatch([output])
        return True

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping = True
        self._go.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self.core is not None:
            self.core.close()

    # -- the engine thread --------------------------------------------------------------------
    def _main(self, build: Callable[[], EngineCore]) -> None:
        name_native_thread()
        try:
            self.core = build()
        except BaseException as exc:  # the constructor raises it
            self._build_error = exc
            return
        finally:
            self._built.set()
        while not self._go.wait(1.0):  # until start() or stop()
            pass
        self._run()

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_calls()
                # first tokens that need no forward (remote KV landed, the lane finished a
                # prompt) go out now, not after the next step's forward
                ready = self._before_step(self.core) if self._before_step else []
                ready += self.core.take_ready_outputs()
                self._dispatch(ready)
                outputs = []
                if self.core.has_unfinished_requests():
                    outputs = self._step()
                    if self._after_step is not None:
                        self._after_step(self.core)
                self._dispatch(outputs)
                if not ready and not outputs and not self._has_runnable():
                    self._wake.wait(self._idle_poll_s if self.core.has_unfinished_requests() else 0.5)
                    self._wake.clear()
        except BaseException as exc:  # the worker reports this in its health; requests get errors
            logger.exception("engine loop died")
            self.error = exc
            self._fail_everything(exc)
            if self._on_death is not None:
                self._on_death(exc)

    def _step(self) -> list[EngineCoreOutput]:
        """One step; a failed forward fails its batch (the core has freed their blocks) and
        the loop carries on with the other requests."""
        try:
            return self.core.step()
        except Exception as exc:
            logger.exception("engine step failed")
            gone = [rid for rid in self._listeners if rid not in self.core.scheduler.requests]
            return [EngineCoreOutput.failed(rid, f"the model step failed: {exc}", ErrorScope.STEP) for rid in gone]

    def _run_calls(self) -> None:
        while True:
            try:
                future, fn, arg = self._calls.get_nowait()
            except queue.Empty:
                return
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(arg))
            except Exception as exc:  # the caller gets it; the loop carries on
                future.set_exception(exc)

    def _has_runnable(self) -> bool:
        scheduler = self.core.scheduler
        return bool(scheduler.running or scheduler.waiting) or not self._calls.empty() or self.core.lane_wants_help()

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        for output in outputs:
            listener = self._listeners.get(output.request_id)
            if output.finish_reason is not None:
                self._listeners.pop(output.request_id, None)
            if listener is not None:
                listener(output)
        if outputs and self._after_outputs is not None:
            self._after_outputs()

    def _fail_everything(self, exc: BaseException) -> None:
        for request_id, listener in list(self._listeners.items()):
            self.core.abort_request(request_id)
            listener(EngineCoreOutput.failed(request_id, f"engine failed: {exc}", ErrorScope.ENGINE))
        self._listeners.clear()
        if self._after_outputs is not None:
            self._after_outputs()
        while True:
            try:
                future, _, _ = self._calls.get_nowait()
            except queue.Empty:
                return
            future.set_exception(EngineLoopStopped(f"engine failed: {exc}"))
