"""The peers script's protocols (bench/peers/vllm_decode.py), run by the bench sides exactly as
with vLLM, against a stand-in `vllm` package with known timings: `make peers` is never part of
`make test`, so this is what checks the plumbing here."""

from __future__ import annotations

import sys

import pytest

from bench.context_bench import ContextBenchConfig, vllm_step_ms
from bench.engine_bench import EngineBenchConfig, vllm_generate_tok_s
from bench.served_bench import ServedBenchConfig, VLLMEngineSide

STEP_S = 0.004  # the stand-in engine's step
# LLM.generate is timed once per case: its sleeps are long enough that a late wake-up on a busy
# machine (a few ms) stays well inside the tolerance
TOKEN_S = 0.01  # the stand-in LLM.generate's time per token
PROMPT_TOKEN_S = 0.001  # and per prompt token (every prompt of the batch)

FAKE_VLLM = f'''
import time

class SamplingParams:
    def __init__(self, max_tokens, ignore_eos=True, temperature=0.0):
        self.max_tokens = max_tokens

class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids

class _RequestOutput:
    def __init__(self, request_id, token_ids):
        self.request_id, self.outputs = request_id, [_Completion(token_ids)]

class _Engine:
    def __init__(self):
        self.requests = {{}}

    def add_request(self, request_id, prompt, params):
        assert prompt["prompt_token_ids"], "token ids, as the benches send"
        self.requests[request_id] = (params.max_tokens, [])

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep({STEP_S})
        outputs = []
        for request_id, (wanted, made) in list(self.requests.items()):
            made.append(7)
            outputs.append(_RequestOutput(request_id, list(made)))
            if len(made) == wanted:
                del self.requests[request_id]
        return outputs

class LLM:
    def __init__(self, **kwargs):
        self.llm_engine = _Engine()

    def generate(self, prompts, params, use_tqdm=True):
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        time.sleep({PROMPT_TOKEN_S} * prompt_tokens + {TOKEN_S} * params.max_tokens)
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return sys.executable


def test_generate_mode_gives_decode_tok_s_per_batch_and_prefill_tok_s(fake_vllm, tmp_path):
    cfg = EngineBenchConfig(model="m", dtypes=("bfloat16",), threads=2, prompt_len=400, batch_sizes=(1, 4),
                            decode_tokens=9, vllm_python=fake_vllm)
    batches = {1: [[5, 6]], 4: [[5, 6]] * 4}
    tok_s, prefill, command = vllm_generate_tok_s(cfg, "bfloat16", tmp_path, batches, [5] * 400)
    # batch x (tokens - 1) / (time of 9 tokens - time of 1) = batch / TOKEN_S
    assert tok_s[1] == pytest.approx(1 / TOKEN_S, rel=0.3)
    assert tok_s[4] == pytest.approx(4 / TOKEN_S, rel=0.3)
    # 400 prompt tokens and one out: 400 / (400 x PROMPT_TOKEN_S + TOKEN_S)
    assert prefill == pytest.approx(400 / (400 * PROMPT_TOKEN_S + TOKEN_S), rel=0.3)
    without, none, _ = vllm_generate_tok_s(cfg, "bfloat16", tmp_path, {1: [[5, 6]]})
    assert none is None and set(without) == {1}
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1" in command and "mode generate" in command


def test_tpot_mode_answers_case_by_case(fake_vllm, tmp_path):
    cfg = ServedBenchConfig(model="m", streams=(1, 3), prompt_len=4, output_len=6, vllm_python=fake_vllm)
    side = VLLMEngineSide(cfg, str(tmp_path), warm_up=[[1, 2, 3, 4]], timeout_s=60)
    try:
        for prompts in ([[1, 2, 3, 4]], [[1, 2, 3, 4]] * 3):
            tpots = side.measure(prompts, 6)
            assert len(tpots) == len(prompts)
            assert all(STEP_S * 1000 * 0.9 < ms < STEP_S * 1000 * 4 for ms in tpots)
        side.pause()  # stopped and continued like a server's process tree
        side.resume()
        assert len(side.measure([[1, 2]], 3)) == 1
    finally:
        side.close()
    assert side.process.returncode == 0


def test_step_mode_gives_the_median_decode_step_per_case(fake_vllm, tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, '
                                          '"num_hidden_layers": 2}')
    cfg = ContextBenchConfig(model="m", dtype="bfloat16", threads=2, context_lens=(8,), batch_sizes=(1, 2),
                             new_tokens=6, vllm_python=fake_vllm)
    cases = [{"context": 8, "batch": batch, "prompts": [[3] * 8] * batch} for batch in (1, 2)]
    step_ms, command, env = vllm_step_ms(cfg, cases, str(tmp_path))
    # the shared loop (bench/peers/step_timing.py), imported by the script from its own directory
    assert len(step_ms) == 2 and all(STEP_S * 1000 * 0.9 < ms < STEP_S * 1000 * 4 for ms in step_ms)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and command[0] == fake_vllm
