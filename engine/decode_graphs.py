"""Decode steps replayed from CUDA graphs: the GPU path's cure for the host cost of a step.

A decode step launches a few hundred small kernels, each from its own Python call. On an H200
the GPU worked 2.4 to 3 ms of a ~21 ms step at batch 64 (docs/triton-kernels.md). The rest was
the host. Here a step whose sequences all decode one token copies its inputs into static
buffers and replays a graph of the whole decoder, captured for its batch size rounded up to a
bucket. The rows past the batch are padding: their K/V write is skipped (slot -1), their
attention reads one position of a valid block, and their outputs are dropped.

A graph is keyed by (bucket, decode splits): the split-K choice is made on the host from the
longest context, and the grid it picks is baked into the capture. Each split reads its range
from the sequence lengths on the device, so one graph serves every context its split count
covers. ``capture_common`` captures every bucket with every split count it can get at start-up
(the worker's warm-up); a key still missing (``capture_common`` not run) is captured when it
first comes.

A capture that fails (an unsupported operation in a model, a driver error) is reported on
stderr and leaves that key eager: the step runs the same forward over the same buffers.

Off CUDA (``capture=False``) the same buffers, padding and keys are used, but each "replay"
runs the forward eagerly. That is the in-process twin the CPU tests drive, with the Triton
kernels interpreted.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from engine.kv_cache.kv_cache import KVCache, padded_block_tables, slot_of
from engine.models.llama import CausalLM
from engine.scheduler_types import ScheduledSeq

# batch sizes captured, as vLLM's default capture sizes: 1, 2, 4, then every 8
BUCKETS = (1, 2, 4, *range(8, 513, 8))


def wants_decode_graphs(device: torch.device, backend, enforce_eager: bool) -> bool:
    """Decode graphs on CUDA with the Triton backend, unless --enforce-eager."""
    return device.type == "cuda" and backend.uses_triton and not enforce_eager


def bucket_for(num_seqs: int) -> int | None:
    """The smallest bucket that holds ``num_seqs`` rows, or None past the largest."""
    for bucket in BUCKETS:
        if bucket >= num_seqs:
            return bucket
    return None


class DecodeGraphs:
    """Static decode inputs and the graphs captured over them, for one model and KV cache."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, backend, max_num_seqs: int, max_model_len: int,
                 capture: bool = True) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend  # TritonAttentionBackend: builds the metadata over the buffers
        self.capture = capture
        self.max_batch = bucket_for(min(max_num_seqs, BUCKETS[-1]))
        self.width = -(-max_model_len // kv_cache.block_size)  # block-table columns
        device = kv_cache.storage.device
        # rows: input ids, positions, slots; int64 as the eager path feeds them
        self.tokens = torch.zeros((3, self.max_batch), dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(self.max_batch, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((self.max_batch, self.width), dtype=torch.int32, device=device)
        # (bucket, splits) -> (graph, its output), or (None, the forward) where it runs eagerly
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph | None, object]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.num_replays = 0
        self.num_padded_rows = 0  # padding rows replayed, over all steps
        self.num_capture_failures = 0  # keys that run eagerly because their capture failed

    def fits(self, seqs: list[ScheduledSeq]) -> bool:
        """Every sequence decodes one token, and the batch and each block table fit the buffers."""
        return (len(seqs) <= self.max_batch and all(len(s.token_ids) == 1 for s in seqs)
                and all(len(s.block_ids) <= self.width for s in seqs))

    def run(self, seqs: list[ScheduledSeq]) -> torch.Tensor:
        """The decoder's output [len(seqs), hidden] for a decode-only step (``fits``)."""
        num = len(seqs)
        bucket = bucket_for(num)
        size = self.kv_cache.block_size
        longest = 1
        tokens = [[0] * bucket, [0] * bucket, [-1] * bucket]  # padding: token 0 at position 0, no write
        seq_lens = [1] * bucket
        for row, seq in enumerate(seqs):
            pos = seq.start_pos
            tokens[0][row] = seq.token_ids[0]
            tokens[1][row] = pos
            tokens[2][row] = slot_of(seq.block_ids, pos, size)
            seq_lens[row] = pos + 1
            longest = max(longest, pos + 1)
        table = padded_block_tables([s.block_ids for s in seqs], torch.int32)
        self.tokens[:, :bucket].copy_(torch.tensor(tokens, dtype=torch.int64), non_blocking=True)
        self.seq_lens[:bucket].copy_(torch.tensor(seq_lens, dtype=torch.int32), non_blocking=True)
        # padding rows keep what they held: any earlier block id (or 0) is a valid block to read
        self.block_tables[:num, :table.shape[1]].copy_(table, non_blocking=True)
        graph, out = self._graph(bucket, longest)
        if graph is None:
            hidden = out()  # the twin: the forward itself, over the same buffers
        else:
            graph.replay()
            hidden = out
        self.num_replays += 1
        self.num_padded_rows += bucket - num
        return hidden[:num]

    def capture_common(self) -> None:
        """Capture every graph a step can need: each bucket (largest first, as the pool grows
        best that way) with each split count the split-K choice gives it for some context up to
        the model's length. Every row is padding, so nothing is written to the KV cache. Done
        at start-up, this is also when Triton compiles the split kernels, which would otherwise
        stall the first step whose contexts cross a split threshold (a second on an H200)."""
        started = time.perf_counter()
        buckets = sorted((b for b in BUCKETS if b <= self.max_batch), reverse=True)
        for bucket in buckets:
            self.tokens[:, :bucket] = torch.tensor([[0], [0], [-1]], dtype=torch.int64)
            self.seq_lens[:bucket] = 1
            for longest in self._split_thresholds(bucket):
                self._graph(bucket, longest)
        kind = "captured" if self.capture else "prepared (eager twin)"
        print(f"[tandem] decode graphs {kind} for batch sizes 1-{buckets[0]} ({len(buckets)} sizes, "
              f"{len(self.graphs)} graphs) in {time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)

    def _split_thresholds(self, bucket: int) -> list[int]:
        """For each split count this bucket can get, the shortest context that gets it
        (contexts 1, 2, 4, ... up to the model's length; the choice never falls as they grow)."""
        first: dict[int, int] = {}
        longest, limit = 1, self.width * self.kv_cache.block_size
        while True:
            first.setdefault(self._splits(bucket, min(longest, limit)), min(longest, limit))
            if longest >= limit:
                return sorted(first.values())
            longest *= 2

    def _splits(self, bucket: int, longest: int) -> int:
        from engine.triton_ops.paged_decode import choose_num_splits

        return choose_num_splits(bucket, self.model.config.num_key_value_heads, longest, self.tokens.device)

    def _graph(self, bucket: int, longest: int):
        key = (bucket, self._splits(bucket, longest))
        if key not in self.graphs:
            self.graphs[key] = self._capture(bucket, longest)
        return self.graphs[key]

    def _capture(self, bucket: int, longest: int) -> tuple[torch.cuda.CUDAGraph | None, object]:
        # the backend picks the same split count from `longest` as the key did
        metadata = self.backend.decode_only_metadata(self.tokens[2, :bucket], self.block_tables[:bucket],
                                                     self.seq_lens[:bucket], longest)
        input_ids, positions = self.tokens[0, :bucket], self.tokens[1, :bucket]

        def forward() -> torch.Tensor:
            return self.model(input_ids, positions, self.kv_cache.layers, metadata)

        try:
            return self._record(forward)
        except Exception as exc:  # a failed capture costs this key its graph, not the worker
            self.num_capture_failures += 1
            print(f"[tandem] decode graph for batch {bucket} ({self._splits(bucket, longest)} splits) failed to "
                  f"capture ({type(exc).__name__}: {exc}); that size runs eagerly", file=sys.stderr, flush=True)
            return None, forward

    def _record(self, forward: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph | None, object]:
        """(graph, its output); off CUDA (None, forward) after running ``forward`` once, as a
        capture runs it eagerly first (capture_graph)."""
        if not self.capture:
            forward()
            return None, forward
        return capture_graph(forward, self.pool)


def capture_graph(forward: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Run ``forward`` once on a side stream (Triton compiles its kernels, cuBLAS picks its
    algorithms, outside any capture), then capture it. Other threads may use the GPU meanwhile
    (a KV import, say): the capture refuses only this thread's unsafe calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out
