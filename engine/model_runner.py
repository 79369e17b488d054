"""Turns a SchedulerOutput into one forward pass, then samples: SchedulerOutput -> RunnerOutput."""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from engine import config
from engine.attention.backend import AttentionBackend, BatchLayout
from engine.decode_graphs import DecodeGraphs
from engine.kv_cache.kv_cache import KVCache, slot_indices, slot_of
from engine.models.llama import CausalLM
from engine.sampler import Sampler, gather_logprobs
from engine.scheduler_types import (
    RunnerOutput,
    SampleFailed,
    ScheduledSeq,
    SchedulerOutput,
    TokenLogprobs,
)


class ModelRunner:
    """Owns the model and the KV tensors; runs exactly one model forward per ``execute``."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 decode_graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.sampler = Sampler()
        # decode-only steps replay CUDA graphs (engine/decode_graphs.py); None: every step eager
        self.decode_graphs = decode_graphs
        self.num_forward_calls = 0
        self.num_tokens_processed = 0  # tokens fed through the model (prefix-cache hits are not)
        # prefill role: receives (request id, layer, first position, kv) after each layer
        self.on_layer_kv: Callable[[str, int, int, torch.Tensor], None] | None = None

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> RunnerOutput:
        if not scheduled.seqs:
            return RunnerOutput(sampled={}, prompt_logprobs={})
        seqs = self._ordered(scheduled)
        hook = self._export_hook(seqs)
        graphs = self.decode_graphs
        if graphs is not None and hook is None and graphs.fits(seqs):
            self.num_forward_calls += 1
            self.num_tokens_processed += len(seqs)
            return self._sample(seqs, graphs.run(seqs))
        return self._sample(seqs, self.model(*self._inputs(seqs), hook))

    @torch.inference_mode()
    def execute_layers(self, scheduled: SchedulerOutput) -> Generator[int, None, RunnerOutput]:
        """``execute`` one layer per ``next()`` (eager: no decode graphs): yields after each
        layer and returns the step's output. Any thread may resume it, one at a time; each layer
        runs on the resuming thread's torch threads (the prefill lane: engine/prefill_lane.py)."""
        seqs = self._ordered(scheduled)
        hidden = yield from self.model.forward_layers(*self._inputs(seqs), self._export_hook(seqs))
        return self._sample(seqs, hidden)

    @staticmethod
    def _ordered(scheduled: SchedulerOutput) -> list[ScheduledSeq]:
        # decodes first: the backend batches them in one padded attention
        return sorted(scheduled.seqs, key=lambda s: len(s.token_ids) != 1)

    def _inputs(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], object]:
        """The model's inputs for ``seqs`` (decodes first): token ids, positions, the KV tensors
        and the attention metadata; counts the forward."""
        bs = self.kv_cache.block_size
        num_decodes = sum(1 for s in seqs if len(s.token_ids) == 1)
        # decodes: one position and one slot each, as plain ints (one tensor for all of them,
        # not three small tensors per sequence); prompt chunks: tensors of their ranges
        decode_positions = [s.start_pos for s in seqs[:num_decodes]]
        positions = [torch.tensor(decode_positions, dtype=torch.int64)]
        slot_mapping = [torch.tensor([slot_of(s.block_ids, p, bs) for s, p in zip(seqs, decode_positions)],
                                     dtype=torch.int64)]
        input_ids = [s.token_ids[0] for s in seqs[:num_decodes]]
        for seq in seqs[num_decodes:]:
            end = seq.start_pos + len(seq.token_ids)
            input_ids.extend(seq.token_ids)
            positions.append(torch.arange(seq.start_pos, end))
            slot_mapping.append(slot_indices(seq.block_ids, seq.start_pos, end, bs))
        layout = BatchLayout(
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
            block_tables=[s.block_ids for s in seqs],
            slot_mapping=torch.cat(slot_mapping) if len(slot_mapping) > 1 else slot_mapping[0],
            num_decodes=num_decodes,
            block_size=bs,
        )
        metadata = self.backend.build_metadata(layout)
        self.num_forward_calls += 1
        self.num_tokens_processed += len(input_ids)
        device = self.kv_cache.storage.device
        return (torch.tensor(input_ids, dtype=torch.int64).to(device),
                (torch.cat(positions) if len(positions) > 1 else positions[0]).to(device),
                self.kv_cache.layers, metadata)

    def _export_hook(self, seqs: list[ScheduledSeq]) -> Callable[[int], None] | None:
        """Export each exporting sequence's KV. Positions this cache already held before the step
        (a prefix-cache hit the receiver lacks) leave at once, every layer from one block pack;
        after each layer, its freshly computed positions follow."""
        if self.on_layer_kv is None:
            return None
        exports = []
        for seq in seqs:
            end = seq.start_pos + len(seq.token_ids)
            if seq.export_from is None or end <= seq.export_from:
                continue
            first = seq.export_from
            if first < seq.start_pos:
                self._export_cached(seq, first, seq.start_pos)
                first = seq.start_pos
            exports.append((seq.request_id, first, self.kv_cache.slots_for(seq.block_ids, first, end)))
        if not exports:
            return None

        def layer_done(layer: int) -> None:
            for request_id, first, slots in exports:
                self.on_layer_kv(request_id, layer, first, self.kv_cache.read_slots(layer, slots))

        return layer_done

    def _export_cached(self, seq: ScheduledSeq, start: int, end: int) -> None:
        """Positions [start, end) are in the cache for every layer: pack their blocks for all
        layers in one go and hand each layer's token range over before the forward runs."""
        bs = self.kv_cache.block_size
        first_block, last_block = start // bs, -(-end // bs)
        packed = self.kv_cache.pack_blocks(seq.block_ids[first_block:last_block], 0, len(self.kv_cache.layers))
        offset = start - first_block * bs
        for layer, blocks in enumerate(packed):  # blocks: [num_blocks, block_size, 2 * kv_heads, head_dim]
            self.on_layer_kv(seq.request_id, layer, start, blocks.flatten(0, 1)[offset : offset + end - start])

    def _sample(self, seqs: list[ScheduledSeq], hidden: torch.Tensor) -> RunnerOutput:
        # Which hidden rows need logits: each sampling seq's last token, and every prompt
        # position of a chunk whose request asked for prompt logprobs.
        sample_rows, sample_seqs = [], []
        prompt_rows: list[tuple[ScheduledSeq, int, int]] = []  # (seq, first flat row, count)
        offset = 0
        for seq in seqs:
            num_new = len(seq.token_ids)
            if seq.sampling is not None:
                sample_rows.append(offset + num_new - 1)
                sample_seqs.append(seq)
            if seq.prompt_logprobs is not None:
                lp = seq.prompt_logprobs
                prompt_rows.append((seq, offset + lp.row_offset, len(lp.target_token_ids)))
            offset += num_new
        sampled, failed = {}, {}
        if sample_rows:
            # [num_sampled, vocab], sampled where they are: on a GPU only the token ids (and the
            # logprobs asked for) come back to the host, not the whole logits
            first, count = sample_rows[0], len(sample_rows)
            # increasing rows: when they are contiguous (every decode step), a view, not a gather
            # through an index list (on a GPU, that list is copied to the device first)
            rows = slice(first, first + count) if sample_rows[-1] - first == count - 1 else sample_rows
            logits = self.model.compute_logits(hidden[rows])
            tokens = self.sampler(logits, [seq.sampling for seq in sample_seqs])
            for seq, token in zip(sample_seqs, tokens):
                if isinstance(token, SampleFailed):
                    failed[seq.request_id] = token.message
                else:
                    sampled[seq.request_id] = token
        prompt_logprobs = {}
        for seq, first, count in prompt_rows:
            try:
                prompt_logprobs[seq.request_id] = self._prompt_logprobs(seq, hidden[first : first + count])
            except Exception as exc:  # its own scoring failed: the others' go on
                failed[seq.request_id] = f"prompt logprobs failed: {type(exc).__name__}: {exc}"
        return RunnerOutput(sampled=sampled, prompt_logprobs=prompt_logprobs, failed=failed)

    def _prompt_logprobs(self, seq: ScheduledSeq, hidden: torch.Tensor) -> list[TokenLogprobs]:
        """Scores ``config.PROMPT_LOGPROBS_ROWS`` positions at a time, so the logits held at once stay
        [PROMPT_LOGPROBS_ROWS, vocab] however long the chunk (a whole --max-num-batched-tokens
        chunk at once would be chunk x vocab floats: 1.6 GB for 8192 x 49152)."""
        request = seq.prompt_logprobs
        targets = torch.tensor(request.target_token_ids, dtype=torch.int64)
        results: list[TokenLogprobs] = []
        step = config.PROMPT_LOGPROBS_ROWS
        for first in range(0, len(targets), step):
            rows = slice(first, first + step)
            logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1).cpu()  # [rows, vocab]
            results += gather_logprobs(logprobs, targets[rows], [request.num_top] * len(targets[rows]))
        return results
