"""A sequence resumed from the tokens another engine already generated and sent (mid-stream
migration, issue 23): the tokens and text that follow equal an uninterrupted run's, under
DESIGN.md's token-equality rule, for greedy and seeded sampling, with penalties, min_tokens,
logprobs and a stop string that spans the point of resumption."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from engine import SamplingParams
from engine.sampling_params import InvalidParam
from tests.reference import TIE_MARGIN, EqualityStats

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Run:
    tokens: list[int] = field(default_factory=list)
    steps: list[tuple[int, str]] = field(default_factory=list)  # each output's (tokens, text handed out)
    gaps: list[float] = field(default_factory=list)  # the top-2 logprob gap at each token (logprobs >= 2)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(delta for _, delta in self.steps)

    def text_sent_with(self, num_tokens: int) -> str:
        """What a client had been sent once the first ``num_tokens`` tokens were out."""
        sent, seen = [], 0
        for count, delta in self.steps:
            if seen + count > num_tokens:
                break
            sent.append(delta)
            seen += count
        return "".join(sent)


def run(core, request_id: str, prompt_ids: list[int], params: SamplingParams, resume: list[int] = ()) -> Run:
    core.add_request(core.make_request(request_id, prompt_ids, params, resume_token_ids=resume))
    out = Run()
    while core.has_unfinished_requests():
        for output in core.step():
            assert output.error is None, output.error
            out.tokens += output.new_token_ids
            out.steps.append((len(output.new_token_ids), output.text_delta))
            for position in output.new_logprobs:
                best = sorted((lp.logprob for lp in position.values()), reverse=True)
                out.gaps.append(best[0] - best[1] if len(best) > 1 else float("inf"))
            if output.finish_reason is not None:
                out.finish_reason, out.stop_reason = output.finish_reason, output.stop_reason
    return out


def assert_resumes_like(reference: Run, resumed: Run, at: int, stats: EqualityStats, label: str) -> None:
    """reference[:at] + resumed == reference (the near-tie rule on the reference's gaps), and the
    text sent before ``at`` plus the resumed deltas is the reference's whole text."""
    stats.compared += 1
    ours = reference.tokens[:at] + resumed.tokens
    for position, (mine, theirs) in enumerate(zip(ours, reference.tokens)):
        if mine != theirs:
            assert reference.gaps[position] < TIE_MARGIN, (
                f"{label}: diverged at output position {position} (resumed at {at}): ours {mine}, reference "
                f"{theirs}, top-2 gap {reference.gaps[position]:.2e} is not a near-tie")
            stats.near_ties += 1
            return
    assert ours == reference.tokens, f"{label}: {len(ours)} tokens vs {len(reference.tokens)}"
    assert reference.text_sent_with(at) + resumed.text == reference.text, label
    assert (resumed.finish_reason, resumed.stop_reason) == (reference.finish_reason, reference.stop_reason), label


CASES = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True, logprobs=2),
    "penalties": SamplingParams(temperature=0.7, seed=7, max_tokens=24, ignore_eos=True, logprobs=2,
                                presence_penalty=0.8, frequency_penalty=0.5, repetition_penalty=1.3),
    "min_tokens": SamplingParams(temperature=0.0, max_tokens=24, min_tokens=20, logprobs=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_resumed_sequence_continues_the_uninterrupted_one(llm, name):
    core, params = llm.engine_core, CASES[name]
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    reference = run(core, f"ref-{name}", prompt_ids, params)
    assert len(reference.tokens) >= 20
    stats, draw = EqualityStats(), random.Random(name)
    for at in sorted({1, len(reference.tokens) - 1, *draw.sample(range(2, len(reference.tokens) - 1), 2)}):
        resumed = run(core, f"resumed-{name}-{at}", prompt_ids, params, resume=reference.tokens[:at])
        assert_resumes_like(reference, resumed, at, stats, f"{name} at {at}")
    assert stats.near_ties <= 1, f"the near-tie rule fired {stats.near_ties} times in {stats.compared}"


def test_a_stop_string_across_the_resumption_point_still_stops(llm):
    core = llm.engine_core
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    free = run(core, "free", prompt_ids, greedy)
    # a stop string made of the end of token k's text and the start of token k+1's: once token k
    # is out, that tail is held back (it may begin the stop string), so it was never sent
    k = next(k for k in range(8, 20) if len(free.steps[k - 1][1]) >= 2 and len(free.steps[k][1]) >= 2
             and (free.steps[k - 1][1][-2:] + free.steps[k][1][:2]) not in free.text_sent_with(k - 1))
    stop = free.steps[k - 1][1][-2:] + free.steps[k][1][:2]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2, stop=[stop])
    reference = run(core, "stopped", prompt_ids, params)
    assert (reference.stop_reason, len(reference.tokens)) == (stop, k + 1)
    assert not reference.text_sent_with(k).endswith(stop[:2])  # held back when the sequence moved
    resumed = run(core, "stopped-resumed", prompt_ids, params, resume=reference.tokens[:k])
    assert_resumes_like(reference, resumed, k, EqualityStats(), "stop string")
    assert resumed.tokens == [reference.tokens[k]]


def test_bad_resumptions_are_refused(llm):
    core = llm.engine_core
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    vocab = llm.engine_core.config.model.arch.vocab_size
    with pytest.raises(InvalidParam, match="resumed token ids"):
        core.make_request("r1", prompt_ids, SamplingParams(max_tokens=8), resume_token_ids=[vocab])
    with pytest.raises(InvalidParam, match="nothing to generate"):
        core.make_request("r2", prompt_ids, SamplingParams(max_tokens=3), resume_token_ids=[5, 6, 7])
    with pytest.raises(InvalidParam, match="prompt logprobs"):
        core.make_request("r3", prompt_ids, SamplingParams(max_tokens=8, prompt_logprobs=1), resume_token_ids=[5])
