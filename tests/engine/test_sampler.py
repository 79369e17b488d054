"""The sampler on hand-built logits, against brute-force definitions."""

from __future__ import annotations

import torch

from engine.sampler import Sampler, position_seed
from engine.sampling_params import SamplingParams
from engine.scheduler_types import SamplingInput

VOCAB = 50


def item(params, output=(), prompt=(1, 2, 3), seed=0, position=10, eos=(0,)):
    return SamplingInput(params, seed, position, list(prompt), list(output), eos)


def test_greedy_and_penalties_follow_their_definitions():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    prompt, output = [4, 5], [5, 6, 6, 6]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)
    # reference: vLLM/HF semantics written out element by element
    expected = logits[0].clone()
    for token in set(prompt + output):
        value = expected[token]
        expected[token] = value / 1.5 if value > 0 else value * 1.5
    for token in set(output):
        expected[token] -= 0.7 * output.count(token) + 0.4
    (token,) = Sampler()(logits.clone(), [item(params, output, prompt)])
    assert token.token_id == int(expected.argmax())


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # EOS is the clear favourite
    logits[0, 9] = 9.0  # then a stop token id
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    (token,) = Sampler()(logits, [item(params, output=[1])])
    assert token.token_id not in (0, 9)
    (token,) = Sampler()(logits, [item(params, output=[1, 1, 1])])
    assert token.token_id == 0


def test_greedy_takes_the_first_maximum_and_leaves_the_callers_logits_alone():
    logits = torch.zeros(3, VOCAB)
    logits[:, [7, 3, 40]] = 2.0  # a three-way tie in every row: the lowest index wins, as argmax's
    logits[2, 3] = float("nan")  # NaN wins, as argmax's
    before = logits.clone()
    plain = SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.0)
    tokens = Sampler()(logits, [item(plain), item(plain), item(plain)])
    assert [t.token_id for t in tokens] == [3, 3, 3]
    assert torch.equal(logits[:, :3], before[:, :3]) and torch.equal(logits.isnan(), before.isnan())
    tokens = Sampler()(logits, [item(plain), item(penalised, output=[3]), item(plain)])
    assert [t.token_id for t in tokens] == [3, 7, 3]  # the penalty moved row 1 only
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # penalties edit a copy


def _empirical(params, logits, draws=3000):
    sampler = Sampler()
    counts = torch.zeros(VOCAB)
    for position in range(draws):
        (token,) = sampler(logits.clone(), [item(params, position=position)])
        counts[token.token_id] += 1
    return counts / draws


def test_top_k_top_p_min_p_support_and_frequencies():
    logits = torch.tensor([[4.0, 3.5, 3.0, 2.0, 1.0] + [-5.0] * (VOCAB - 5)])
    probs = logits[0].softmax(-1)
    # top_p = 0.8: keep the smallest prefix (by probability) whose mass reaches 0.8
    cumulative = probs.sort(descending=True).values.cumsum(0)
    keep = int((cumulative < 0.8).sum()) + 1
    freq = _empirical(SamplingParams(temperature=1.0, top_p=0.8), logits)
    assert set(freq.nonzero().flatten().tolist()) <= set(range(keep))
    expected = probs[:keep] / probs[:keep].sum()
    assert torch.allclose(freq[:keep], expected, atol=0.04)
    freq = _empirical(SamplingParams(temperature=1.0, top_k=2), logits, draws=1000)
    assert set(freq.nonzero().flatten().tolist()) == {0, 1}
    # min_p = 0.3: drop tokens below 0.3 * p_max
    allowed = (probs >= 0.3 * probs.max()).nonzero().flatten().tolist()
    freq = _empirical(SamplingParams(temperature=1.0, min_p=0.3), logits, draws=1000)
    assert set(freq.nonzero().flatten().tolist()) <= set(allowed)


def test_draw_depends_only_on_seed_and_position():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0)
    batch = Sampler()(logits.clone(), [item(params, seed=11, position=4), item(params, seed=12), item(params, seed=13)])
    alone = Sampler()(logits[:1].clone(), [item(params, seed=11, position=4)])
    assert batch[0].token_id == alone[0].token_id
    assert position_seed(11, 4) == position_seed(11, 4) != position_seed(11, 5)
