"""One request's own failure ends that request only: its sampling, its stop handling, its
detokenizing fail it with an error of scope REQUEST while the step goes on for the others,
which get the tokens they get alone, and nothing stays allocated."""

from __future__ import annotations

import pytest
import torch

from engine import SamplingParams
from engine.engine_core import ErrorScope
from engine.sampler import Sampler
from engine.scheduler_types import SampleFailed, SamplingInput
from tests.conftest import make_llm
from tests.reference import EqualityStats, assert_same_as_engine_reference

NEIGHBOURS = ["The quick brown fox", "Water boils at", "Once upon a time there"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return make_llm(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=256)


def _run(core, requests) -> dict:
    """Add the engine requests, step to the end; request id -> its outputs."""
    for request in requests:
        core.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while core.has_unfinished_requests():
        for output in core.step():
            outputs[output.request_id].append(output)
    return outputs


def _unchecked(core, request_id: str, prompt: list[int], **changes):
    """A request whose parameters skipped every check (as if a validation were missing)."""
    request = core.make_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    params = request.sampling_params
    for name, value in changes.items():
        object.__setattr__(params, name, value)
    return request


def _assert_neighbours_alone(tiny, core, outputs, label):
    stats = EqualityStats()
    for index, prompt in enumerate(NEIGHBOURS):
        mine = [t for o in outputs[f"n{index}"] for t in o.new_token_ids]
        assert outputs[f"n{index}"][-1].finish_reason == "length", outputs[f"n{index}"][-1]
        alone = tiny.generate(prompt, GREEDY)[0].outputs[0]
        assert_same_as_engine_reference(mine, alone, stats, label=f"{label}: {prompt}")
    print(f"{label}: near-tie rule fired {stats.near_ties} of {stats.compared}")
    assert stats.near_ties <= 1
    core.check_integrity()
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks


def _neighbours(tiny, core):
    tokenizer = tiny.get_tokenizer()
    return [core.make_request(f"n{i}", tokenizer.encode(p), GREEDY) for i, p in enumerate(NEIGHBOURS)]


def test_a_stop_token_id_past_the_vocabulary_fails_its_request_only(tiny):
    core = tiny.engine_core
    vocab = core.config.model.arch.vocab_size
    # the engine itself refuses it up front ...
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, ") as caught:
        core.make_request("p", [5, 6, 7], SamplingParams(min_tokens=2, stop_token_ids=[vocab]))
    assert caught.value.param == "stop_token_ids"
    # ... and one that got past it breaks only its own sampling (min_tokens blocks the id in the logits)
    poison = _unchecked(core, "poison", [5, 6, 7], min_tokens=2, stop_token_ids=(vocab,))
    outputs = _run(core, _neighbours(tiny, core) + [poison])
    last = outputs["poison"][-1]
    assert last.finish_reason == "error" and last.error_scope is ErrorScope.REQUEST, last
    assert "sampling failed" in last.error and not [t for o in outputs["poison"] for t in o.new_token_ids]
    _assert_neighbours_alone(tiny, core, outputs, "stop id past the vocabulary")


def test_a_failing_detokenizer_fails_its_request_only(tiny, monkeypatch):
    core = tiny.engine_core
    poison = core.make_request("poison", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    real_new = core._new_detokenizer

    def new_detokenizer(request):
        real_new(request)
        if request.request_id == "poison":
            detok = core._detokenizers["poison"]
            monkeypatch.setattr(detok, "add_token", lambda token_id: 1 / 0)

    monkeypatch.setattr(core, "_new_detokenizer", new_detokenizer)
    outputs = _run(core, _neighbours(tiny, core) + [poison])
    last = outputs["poison"][-1]
    assert last.finish_reason == "error" and last.error_scope is ErrorScope.REQUEST
    assert "ZeroDivisionError" in last.error
    _assert_neighbours_alone(tiny, core, outputs, "detokenizer fault")


def test_a_failed_forward_is_a_step_fault(tiny, monkeypatch):
    """The other side of the line: a fault of the step itself fails the whole batch."""
    core = tiny.engine_core
    monkeypatch.setattr(core.runner.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    for request in _neighbours(tiny, core):
        core.add_request(request)
    with pytest.raises(RuntimeError, match="boom"):
        core.step()
    assert not core.has_unfinished_requests()
    assert core.block_pool.num_free_blocks == core.block_pool.num_blocks


def test_sampler_falls_back_to_rows_and_gives_the_batch_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    inputs = [SamplingInput(SamplingParams(temperature=t, seed=s, logprobs=2), s, 7, [1, 2], [3], (0,))
              for t, s in ((0.0, 1), (0.8, 2), (1.2, 3), (0.5, 4))]
    batched = Sampler()(logits, inputs)
    broken = SamplingInput(SamplingParams(), 9, 7, [1], [], (0,))
    object.__setattr__(broken.params, "stop_token_ids", (50,))
    object.__setattr__(broken.params, "min_tokens", 5)
    mixed = Sampler()(torch.cat([logits[:2], torch.randn(1, 50), logits[2:]]), inputs[:2] + [broken] + inputs[2:])
    assert isinstance(mixed[2], SampleFailed) and "IndexError" in mixed[2].message
    assert [t.token_id for t in mixed[:2] + mixed[3:]] == [t.token_id for t in batched]
    assert [t.logprobs for t in mixed[:2] + mixed[3:]] == [t.logprobs for t in batched]


def test_prompt_logprobs_in_slices_equal_one_matrix(tiny, monkeypatch):
    prompt = list(range(100, 180))
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    whole = tiny.generate({"prompt_token_ids": prompt}, params)[0].prompt_logprobs
    monkeypatch.setattr("engine.config.PROMPT_LOGPROBS_ROWS", 7)
    sliced = tiny.generate({"prompt_token_ids": prompt}, params)[0].prompt_logprobs
    assert len(sliced) == len(prompt) and sliced[0] is None
    for a, b in zip(whole[1:], sliced[1:]):
        assert a.keys() == b.keys()
        for token_id in a:
            assert a[token_id].rank == b[token_id].rank
            assert abs(a[token_id].logprob - b[token_id].logprob) < 1e-5
