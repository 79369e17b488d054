"""Batched sampling with per-request parameters.

Order of operations (as vLLM): logprobs are taken from the raw logits; then min_tokens
blocking, penalties, temperature, min_p, top_k, top_p; then greedy argmax or a seeded draw.
A draw uses the exponential-race trick (argmax of p / q with q ~ Exp(1)), whose noise comes
from a generator seeded by (request seed, token position) alone, so the token does not
depend on which other requests shared the batch, or on which worker ran the step.
"""

from __future__ import annotations

import hashlib

import torch

from engine.scheduler_types import SampledToken, SampleFailed, SamplingInput, TokenLogprobs


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed that depends only on (seed, position)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """logprobs: [n, vocab]; chosen: [n] token ids -> per row, chosen first then top-N."""
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [n, 1]
    chosen_rank = (logprobs > chosen_lp).sum(dim=1) + 1  # [n]
    max_top = max(num_top, default=0)
    # each tensor leaves the device once (on a GPU, one copy each rather than one per value)
    top_lp, top_ids = (t.tolist() for t in logprobs.topk(max_top, dim=1)) if max_top else ([], [])
    chosen_ids, chosen_lps, chosen_ranks = chosen.tolist(), chosen_lp[:, 0].tolist(), chosen_rank.tolist()
    results = []
    for row, n_top in enumerate(num_top):
        ids, lps, ranks = [chosen_ids[row]], [chosen_lps[row]], [chosen_ranks[row]]
        if n_top:
            ids += top_ids[row][:n_top]
            lps += top_lp[row][:n_top]
            ranks += list(range(1, n_top + 1))
        results.append(TokenLogprobs(token_ids=ids, logprobs=lps, ranks=ranks))
    return results


def _below_min_tokens(item: SamplingInput) -> bool:
    """Stop tokens are blocked for this row: it has fewer than ``min_tokens`` outputs."""
    return len(item.output_token_ids) < item.params.min_tokens


def _block_stop_tokens(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    for row, item in enumerate(inputs):
        if _below_min_tokens(item):
            blocked = list(item.eos_token_ids) + list(item.params.stop_token_ids)
            if blocked:
                logits[row, blocked] = float("-inf")


def _apply_penalties(logits: torch.Tensor, inputs: list[SamplingInput]) -> None:
    vocab = logits.shape[1]
    for row, item in enumerate(inputs):
        params = item.params
        if not params.has_penalties:
            continue
        output_ids = torch.tensor(item.output_token_ids, dtype=torch.int64, device=logits.device)
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(item.prompt_token_ids + item.output_token_ids, dtype=torch.int64,
                                device=logits.device).unique()
            values = logits[row, seen]
            penalty = params.repetition_penalty
            logits[row, seen] = torch.where(values > 0, values / penalty, values * penalty)
        if params.frequency_penalty or params.presence_penalty:
            counts = torch.bincount(output_ids, minlength=vocab).to(logits.dtype)  # [vocab]
            logits[row] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)


def _filter(logits: torch.Tensor, inputs: list[SamplingInput]) -> torch.Tensor:
    """min_p, top_k, top_p on temperature-scaled logits [n, vocab] -> masked logits."""
    device = logits.device
    min_p = torch.tensor([i.params.min_p for i in inputs], device=device)
    top_k = torch.tensor([i.params.effective_top_k for i in inputs], device=device)
    top_p = torch.tensor([i.params.top_p for i in inputs], device=device)
    if any(i.params.min_p > 0 for i in inputs):  # decided from the params: no device round trip
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if any(i.params.effective_top_k > 0 or i.params.top_p < 1 for i in inputs):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(logits.shape[1], device=device).unsqueeze(0)  # [1, vocab]
        k = torch.where(top_k > 0, top_k, logits.shape[1]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(rank >= k, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the tokens ranked above it already reach top_p (the top one stays)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        nucleus = torch.where(top_p < 1, top_p, float("inf")).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mass_before > nucleus, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return logits


class Sampler:
    """Picks one token per row of ``logits`` ([n, vocab] float32) under each row's params, on
    the device the logits are on (a seeded draw's noise comes from a CPU generator either way).

    Rows are independent (each row's operations read only that row, and its draw has its own
    generator), so when the batch fails, each row is sampled on its own: a row whose own
    parameters break sampling gets ``SampleFailed`` and the others the tokens they would have
    got in the batch."""

    def __call__(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> list[SampledToken | SampleFailed]:
        try:
            return self._sample(logits, inputs)
        except Exception:
            pass
        results: list[SampledToken | SampleFailed] = []
        for row, item in enumerate(inputs):
            try:
                results.extend(self._sample(logits[row : row + 1], [item]))
            except Exception as exc:
                results.append(SampleFailed(f"sampling failed: {type(exc).__name__}: {exc}"))
        return results

    def _sample(self, logits: torch.Tensor, inputs: list[SamplingInput]) -> list[SampledToken]:
        wants_logprobs = [i.params.logprobs is not None for i in inputs]
        raw_logprobs = logits.log_softmax(dim=-1) if any(wants_logprobs) else None
        # edited in place below only where a row blocks stop tokens or has penalties: the copy
        # of [n, vocab] float32 logits is otherwise skipped
        edited = any(_below_min_tokens(i) or i.params.has_penalties for i in inputs)
        processed = logits.clone() if edited else logits
        _block_stop_tokens(processed, inputs)
        _apply_penalties(processed, inputs)
        # [n] greedy choice; random rows are replaced below. max's indices are argmax's (the
        # first maximum; NaN wins) at a third of its time on the CPU for [64, 49152] logits
        chosen = processed.max(dim=-1).indices
        random_rows = [row for row, item in enumerate(inputs) if not item.params.is_greedy]
        if random_rows:
            subset = [inputs[row] for row in random_rows]
            temperature = torch.tensor([item.params.temperature for item in subset], device=logits.device).unsqueeze(1)
            scaled = _filter(processed[random_rows] / temperature, subset)
            probs = scaled.softmax(dim=-1)  # [r, vocab]
            for offset, (row, item) in enumerate(zip(random_rows, subset)):
                # drawn on the CPU whatever the device: the same seed gives the same token on both
                generator = torch.Generator().manual_seed(position_seed(item.seed, item.position))
                noise = torch.empty(probs.shape[1]).exponential_(generator=generator).to(probs.device)
                chosen[row] = (probs[offset] / noise).argmax()
        lp_rows = [row for row, wanted in enumerate(wants_logprobs) if wanted]
        token_lps: dict[int, TokenLogprobs] = {}
        if lp_rows:
            gathered = gather_logprobs(
                raw_logprobs[lp_rows], chosen[lp_rows], [inputs[row].params.logprobs for row in lp_rows]
            )
            token_lps = dict(zip(lp_rows, gathered))
        return [SampledToken(token, token_lps.get(row)) for row, token in enumerate(chosen.tolist())]
