"""Shared fixtures: the default model, a float32 engine on it, the transformers reference,
and the block-pool check that runs after every test."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from engine.models.fetch import resolve_model
from engine.models.registry import DEFAULT_MODEL, KNOWN_MODELS

torch.set_num_threads(int(os.environ.get("TANDEM_TEST_THREADS", "2")))
# Without a GPU, Triton kernels run interpreted on CPU tensors; Triton reads this when a kernel
# is defined, so it is set before any test imports engine.triton_ops.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def make_llm(**kwargs):
    """Build an LLM that the after-test integrity check will inspect."""
    from engine import LLM

    llm = LLM(**kwargs)
    _ENGINES.add(llm)
    return llm


def make_engine_pair(model_dir):
    """A prefill engine and a decode engine (float32, separate caches) for transfer tests."""
    kwargs = dict(model=str(model_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024)
    return make_llm(**kwargs).engine_core, make_llm(**kwargs).engine_core


@pytest.fixture(autouse=True)
def _block_pool_integrity():
    yield
    for llm in list(_ENGINES):
        core = llm.engine_core
        core.check_integrity()
        assert not core.has_unfinished_requests(), "a test left requests in the engine"
        pool = core.block_pool
        assert pool.num_free_blocks == pool.num_blocks, (
            f"{pool.num_blocks - pool.num_free_blocks} KV blocks still allocated after the test"
        )


@pytest.fixture(scope="session")
def smollm_dir():
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm_gguf(smollm_dir):
    """The original GGUF that the cached safetensors were converted from."""
    name = KNOWN_MODELS[DEFAULT_MODEL].wheel_member.rsplit("/", 1)[-1]
    return smollm_dir.parent / name


@pytest.fixture(scope="session")
def llm(smollm_dir):
    """SmolLM2 in float32 (the reference dtype for token-equality tests)."""
    return make_llm(model=str(smollm_dir), dtype="float32", num_kv_blocks=1024)


@pytest.fixture(scope="session")
def hf_smollm(smollm_gguf):
    """transformers' own loading of the same GGUF: the independent reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(smollm_gguf.parent), smollm_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm_dir):
    """A tiny random Llama checkpoint (SmolLM2's tokenizer), for tests where the real model is
    not the point."""
    from tests.tiny_model import write_tiny_checkpoint

    directory = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_checkpoint("llama", directory, smollm_dir)
    return directory


@pytest.fixture(scope="module")
def smollm_decode_worker(smollm_dir):
    """A decode worker in this process (real gRPC on loopback), one thread, float32."""
    from decode_worker.worker import DecodeWorker, DecodeWorkerConfig
    from engine.llm import EngineArgs
    from tests.workers import SECRET
    from worker_runtime.server import ServerConfig

    engine = EngineArgs(model=str(smollm_dir), dtype="float32", num_kv_blocks=256, max_model_len=1024, num_threads=1)
    worker = DecodeWorker(DecodeWorkerConfig(engine, ServerConfig("127.0.0.1", 0, SECRET)))
    worker.start()
    yield worker
    worker.stop()
