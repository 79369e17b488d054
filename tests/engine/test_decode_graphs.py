"""Decode steps through the static buffers of engine/decode_graphs.py, driven by the in-process
twin (``capture=False``: each replay runs the forward eagerly over the same buffers) with the
Triton kernels interpreted. On a GPU the same path replays CUDA graphs; bench/gpu_engine.py
checks that against transformers there."""

from __future__ import annotations

import random

import pytest
import torch

from engine.decode_graphs import BUCKETS, DecodeGraphs, bucket_for
from engine.triton_ops import paged_decode
from engine.triton_ops.common import LAUNCHES


def test_a_batch_rounds_up_to_the_smallest_bucket_that_holds_it():
    assert [bucket_for(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65, 512)] == [1, 2, 4, 4, 8, 8, 16, 64, 72, 512]
    assert bucket_for(513) is None
    assert list(BUCKETS[:5]) == [1, 2, 4, 8, 16] and all(b - a == 8 for a, b in zip(BUCKETS[3:], BUCKETS[4:]))


def _engine(model_dir, **extra):
    from tests.conftest import make_llm

    return make_llm(model=str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                    max_num_batched_tokens=48, num_threads=1, attention_backend="triton", max_num_seqs=8, **extra)


def _with_twin(llm) -> DecodeGraphs:
    core = llm.engine_core
    graphs = DecodeGraphs(core.model, core.kv_cache, core.runner.backend, core.config.scheduler.max_num_seqs,
                          core.config.model.max_model_len, capture=False)
    core.runner.decode_graphs = graphs
    return graphs


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(5)
    return [[rng.randrange(3, 49000) for _ in range(n)] for n in (3, 17, 40, 9, 30)]


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_steps_through_the_static_buffers_generate_the_eager_tokens(tiny_llama_dir, prompts, monkeypatch,
                                                                          splits):
    """Five requests ending one after another, so the decode batch shrinks through buckets 4, 2
    and 1, with padding rows where it holds 3; prompt chunks share steps with decodes
    (those steps stay eager). The tokens equal the eager engine's, and so do the prompt
    logprobs, over split-K graphs too."""
    from engine import SamplingParams

    def choose(num_seqs, num_kv_heads, longest, device):  # split-K once contexts pass 40 positions
        return splits if longest > 40 else 1

    monkeypatch.setattr(paged_decode, "choose_num_splits", choose)
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 4 * i, ignore_eos=True, logprobs=2) for i in range(5)]
    requests = [{"prompt_token_ids": p} for p in prompts]
    eager = [o.outputs[0] for o in _engine(tiny_llama_dir).generate(requests, params)]
    llm = _engine(tiny_llama_dir)
    graphs = _with_twin(llm)
    before = LAUNCHES["paged_decode_split"]
    static = [o.outputs[0] for o in llm.generate(requests, params)]
    assert [o.token_ids for o in static] == [o.token_ids for o in eager]
    for ours, theirs in zip(static, eager):
        for a, b in zip(ours.logprobs, theirs.logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert {bucket for bucket, _ in graphs.graphs} >= {4, 2, 1}
    assert graphs.num_padded_rows > 0  # three sequences in bucket 4, at least
    assert graphs.num_replays >= 15  # the last request alone decodes for 10+ steps
    assert llm.engine_core.runner.num_forward_calls > graphs.num_replays  # the prompt steps ran eagerly
    if splits > 1:
        assert any(splits_of == 2 for _, splits_of in graphs.graphs)
        assert LAUNCHES["paged_decode_split"] > before


def test_capturing_every_bucket_writes_nothing_into_the_kv_cache(tiny_llama_dir, prompts, capsys, monkeypatch):
    """``capture_common`` (a GPU worker's warm-up) runs each bucket, with each split count it can
    get, over padding rows only: every K/V write is skipped, so blocks that hold a request's
    context are untouched."""
    from engine import SamplingParams

    def choose(num_seqs, num_kv_heads, longest, device):  # split-K once contexts pass 40 positions
        return 2 if longest > 40 else 1

    monkeypatch.setattr(paged_decode, "choose_num_splits", choose)

    llm = _engine(tiny_llama_dir)
    llm.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    core = llm.engine_core
    assert core.block_pool.num_cached_blocks > 0  # the prompt's full blocks stay cached
    snapshot = core.kv_cache.storage.clone()
    graphs = _with_twin(llm)
    launched, split = LAUNCHES["kv_write"], LAUNCHES["paged_decode_split"]
    graphs.capture_common()
    assert set(graphs.graphs) == {(bucket, splits) for bucket in (1, 2, 4, 8) for splits in (1, 2)}
    assert "decode graphs prepared (eager twin) for batch sizes 1-8 (4 sizes, 8 graphs) in" in capsys.readouterr().err
    layers = core.config.model.arch.num_hidden_layers
    assert LAUNCHES["kv_write"] - launched == 8 * layers and LAUNCHES["paged_decode_split"] - split == 4 * layers
    assert torch.equal(core.kv_cache.storage.nan_to_num(), snapshot.nan_to_num())
    # and the cached prefix still gives what a fresh engine computes
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": prompts[2] + [11, 12]}], params)[0]
    assert again.num_cached_tokens > 0
    fresh = _engine(tiny_llama_dir).generate([{"prompt_token_ids": prompts[2] + [11, 12]}], params)[0]
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids


def test_steps_that_do_not_fit_the_buffers_run_eagerly(tiny_llama_dir):
    """More sequences than the largest bucket, or a prompt chunk in the step: eager."""
    from engine.scheduler_types import ScheduledSeq

    llm = _engine(tiny_llama_dir)
    graphs = _with_twin(llm)

    def seq(tokens, start, blocks=(0, 1)):
        return ScheduledSeq(request_id="r", token_ids=tokens, start_pos=start, block_ids=list(blocks),
                            sampling=None, prompt_logprobs=None)

    assert graphs.max_batch == 8 and graphs.width == 16
    assert graphs.fits([seq([5], 3)] * 8)
    assert not graphs.fits([seq([5], 3)] * 9)
    assert not graphs.fits([seq([5], 3), seq([5, 6], 3)])
    assert graphs.fits([seq([5], 255, range(16))])
    assert not graphs.fits([seq([5], 3, range(17))])


def test_graphs_are_made_on_cuda_with_triton_unless_enforce_eager(tiny_llama_dir):
    """Where the engine makes decode graphs: CUDA and the Triton backend, and not enforce_eager
    (vLLM's flag; the serve flag: tests/cluster/test_serve_config.py). On this CPU the engine
    makes none, and the flag reaches its config."""
    from engine.decode_graphs import wants_decode_graphs

    class Backend:
        def __init__(self, uses_triton):
            self.uses_triton = uses_triton

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert wants_decode_graphs(cuda, Backend(True), enforce_eager=False)
    assert not wants_decode_graphs(cuda, Backend(True), enforce_eager=True)
    assert not wants_decode_graphs(cuda, Backend(False), enforce_eager=False)
    assert not wants_decode_graphs(cpu, Backend(True), enforce_eager=False)
    llm = _engine(tiny_llama_dir, enforce_eager=True)
    assert llm.engine_core.config.enforce_eager is True
    assert _engine(tiny_llama_dir).engine_core.runner.decode_graphs is None


def test_a_capture_that_fails_leaves_that_size_eager_and_the_tokens_right(tiny_llama_dir, prompts, monkeypatch,
                                                                          capsys):
    """The first capture raises (as a CUDA capture does on an operation it cannot record): the
    worker says so on stderr, that key runs the forward eagerly over the same buffers from then
    on, and every request still gets the eager engine's tokens."""
    from engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts[:3]]
    eager = [o.outputs[0].token_ids for o in _engine(tiny_llama_dir).generate(requests, params)]
    llm = _engine(tiny_llama_dir)
    graphs = _with_twin(llm)
    record, failed = graphs._record, []

    def first_fails(forward):
        if not failed:
            failed.append(True)
            raise RuntimeError("operation not permitted when stream is capturing")
        return record(forward)

    monkeypatch.setattr(graphs, "_record", first_fails)
    assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == eager
    assert graphs.num_capture_failures == 1 and graphs.num_replays > 0
    assert len(graphs.graphs) >= 2  # the failed key stays (eager), the others were captured
    assert "failed to capture (RuntimeError: operation not permitted" in capsys.readouterr().err
