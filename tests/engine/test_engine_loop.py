"""EngineLoop builds its core on the engine thread and steps it there (engine/engine_loop.py
says why: one OpenMP team per process); a failed or late build is an error, not a hang."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

import worker_runtime.runtime as runtime_module
from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
from engine.engine_loop import AddRequest, EngineLoop, build_engine
from engine.llm import EngineArgs
from engine.sampling_params import SamplingParams
from prefill_worker.worker import PrefillWorker, PrefillWorkerConfig
from tests.workers import SECRET
from worker_runtime.server import ServerConfig


def tiny_args(model_dir) -> EngineArgs:
    return EngineArgs(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)


def native_name(thread: threading.Thread) -> str:
    """The OS's name for a live thread of this process (what top -H and py-spy show)."""
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


def test_the_core_is_built_and_stepped_on_the_engine_thread(tiny_llama_dir):
    threads = {}

    def build():
        threads["build"] = threading.current_thread()
        return build_engine(tiny_args(tiny_llama_dir))

    loop = EngineLoop(build)
    assert threads["build"] is not threading.main_thread()
    assert threads["build"].name == "engine-loop"
    finished = threading.Event()
    outputs = []

    def listener(output):
        threads["call"] = threading.current_thread()  # where the request's step ran
        outputs.append(output)
        if output.finish_reason:
            finished.set()

    loop.start()
    try:
        loop.add(AddRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=5, ignore_eos=True), listener)).result(30)
        assert finished.wait(60), "the request did not finish"
    finally:
        loop.stop()
    assert threads["call"] is threads["build"]
    assert sum(len(output.new_token_ids) for output in outputs) == 5
    assert outputs[-1].finish_reason == "length"


def test_a_failed_build_raises_its_error_and_leaves_no_thread():
    def build():
        raise ValueError("no such model")

    before = {thread.name for thread in threading.enumerate()}
    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(build)
    assert "engine-loop" not in {thread.name for thread in threading.enumerate()} - before


def test_a_build_past_its_deadline_raises_and_never_steps():
    release = threading.Event()
    built = threading.Event()

    class Core:  # stepping it would fail the test: the loop must not start
        def has_unfinished_requests(self):
            raise AssertionError("a loop whose build timed out was stepped")

    def build():
        release.wait(30)
        built.set()
        return Core()

    with pytest.raises(RuntimeError, match="not built within"):
        EngineLoop(build, build_timeout_s=0.2)
    release.set()
    assert built.wait(10)


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_workers_build_their_core_on_their_engine_thread(role, tiny_llama_dir, monkeypatch):
    built_on = []

    def recording_build(args):
        built_on.append(threading.current_thread().name)
        return build_engine(args)

    monkeypatch.setattr(runtime_module, "build_engine", recording_build)
    server = ServerConfig("127.0.0.1", 0, SECRET)
    if role == "decode":
        worker = DecodeWorker(DecodeWorkerConfig(tiny_args(tiny_llama_dir), server))
    else:
        worker = PrefillWorker(PrefillWorkerConfig(tiny_args(tiny_llama_dir), server))
    try:
        assert built_on == ["engine-loop"]
        assert worker.core is worker.engine_loop.core
        if sys.platform.startswith("linux"):  # the OS sees the same names (top -H, py-spy, /proc)
            worker.runtime.server.start()
            assert native_name(worker.engine_loop._thread) == "engine-loop"
            assert native_name(worker.runtime.server._thread) == "grpc-aio"
    finally:
        if worker.runtime.server.port is not None:  # started above
            worker.runtime.server.stop()
        worker.engine_loop.stop()


def test_after_outputs_runs_once_per_batch_after_its_listeners(tiny_llama_dir):
    events = []
    finished = threading.Event()
    loop = EngineLoop(lambda: build_engine(tiny_args(tiny_llama_dir)), after_outputs=lambda: events.append("flush"))

    def listener(output):
        events.append(output.request_id)
        if output.finish_reason and output.request_id == "r2":
            finished.set()

    try:  # queued before the loop starts, so that its first step decodes all three together
        added = [loop.add(AddRequest(f"r{index}", [1, 2, 3, 4 + index], SamplingParams(max_tokens=6, ignore_eos=True),
                                     listener)) for index in range(3)]
        loop.start()
        for future in added:
            future.result(30)
        assert finished.wait(60)
    finally:
        loop.stop()
    assert events[-1] == "flush" and events[0] != "flush"
    batches = "|".join(events).split("|flush")
    batches = [b.strip("|") for b in batches if b.strip("|")]
    assert all(b for b in batches)  # never two flushes without an output between them
    assert [sorted(b.split("|")) for b in batches] == [["r0", "r1", "r2"]] * 6
