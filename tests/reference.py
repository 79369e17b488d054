"""Reference generation with transformers and DESIGN.md's token-equality rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch

TIE_MARGIN = 1e-3  # float32 logits closer than this may legitimately round either way
# the same rule for bfloat16 runs (8-bit mantissas). The logits come out of the bfloat16 lm_head,
# so two top logits can differ by whole bfloat16 steps: 0.125 for SmolLM2's top logits (16 to
# 32). Measured: torch's own SDPA path diverges from itself between two chunkings of a prompt at
# top-2 gaps of 0.009-0.014 (EPYC), and the prefill kernel from SDPA at a gap of exactly 0.125 (one
# step) on a Xeon; the margin is two steps.
BF16_TIE_MARGIN = 0.25


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with transformers' own forward and KV cache, no stopping on EOS.
    Returns the tokens and the raw logits each was chosen from."""
    input_ids = torch.tensor([prompt_ids])
    past = None
    tokens, logits_per_step = [], []
    for _ in range(max_new_tokens):
        out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
        logits = out.logits[0, -1].float()
        past = out.past_key_values
        token = int(logits.argmax())
        tokens.append(token)
        logits_per_step.append(logits)
        input_ids = torch.tensor([[token]])
    return tokens, logits_per_step


@dataclass
class EqualityStats:
    compared: int = 0
    near_ties: int = 0  # sequences where a divergence at a near-tie was allowed


def assert_token_equal(ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], stats: EqualityStats, label=""):
    """Equal, except a divergence is allowed at a position where the reference's two best
    logits are within TIE_MARGIN; the rest of that sequence is then not compared."""
    stats.compared += 1
    for position, (mine, theirs) in enumerate(zip(ours, ref)):
        if mine != theirs:
            top2 = ref_logits[position].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_MARGIN, (
                f"{label}: diverged at generated position {position}: ours {mine}, reference "
                f"{theirs}, reference top-2 logit gap {gap:.2e} is not a near-tie"
            )
            stats.near_ties += 1
            return
    assert len(ours) == len(ref), f"{label}: {len(ours)} tokens vs reference {len(ref)}"


def assert_same_as_engine_reference(ours: list[int], reference, stats: EqualityStats, label="",
                                    margin: float = TIE_MARGIN):
    """The token-equality rule against another engine run (a CompletionOutput generated
    greedily with ``logprobs>=2``): its two best logprobs give the reference's top-2 logit
    gap at each position (log_softmax preserves differences)."""
    _compare_with_gaps(ours, list(reference.token_ids), _reference_gaps(reference), stats, label, margin)


def assert_same_tokens_as_text(ours: list[str], reference, stats: EqualityStats, label=""):
    """The same rule when only each token's text is known (the OpenAI API's logprobs)."""
    texts = [entry[token_id].decoded_token for entry, token_id in zip(reference.logprobs, reference.token_ids)]
    _compare_with_gaps(ours, texts, _reference_gaps(reference), stats, label)


def _reference_gaps(reference) -> list[float]:
    gaps = []
    for entry in reference.logprobs:
        best = sorted((lp.logprob for lp in entry.values()), reverse=True)
        gaps.append(best[0] - best[1])
    return gaps


def _compare_with_gaps(ours: list, theirs: list, gaps: list[float], stats: EqualityStats, label: str,
                      margin: float = TIE_MARGIN) -> None:
    stats.compared += 1
    for position, (mine, ref) in enumerate(zip(ours, theirs)):
        if mine != ref:
            assert gaps[position] < margin, (
                f"{label}: diverged at position {position} (ours {mine!r}, reference {ref!r}); "
                f"reference top-2 gap {gaps[position]:.2e} is not a near-tie"
            )
            stats.near_ties += 1
            return
    assert len(ours) == len(theirs), f"{label}: {len(ours)} vs {len(theirs)} tokens"
