"""Independent references for the kernels (tests, bench/gpu_kernels.py): a paged cache filled
with random context and NaN everywhere else, and dense scaled_dot_product_attention on K/V
gathered slot by slot. Plain torch, any device."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PagedCache:
    """A cache of NaN with each sequence's context written, as random values, into blocks taken
    in a shuffled order (block tables are not contiguous); ``spare`` blocks stay NaN."""

    def __init__(self, seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype,
                 seed: int, device="cpu", spare: int = 3):
        gen = torch.Generator().manual_seed(seed)
        self.block_size, self.num_kv_heads, self.seq_lens = block_size, num_kv_heads, seq_lens
        num_blocks = sum(-(-n // block_size) for n in seq_lens) + spare
        self.cache = torch.full((num_blocks, block_size, 2 * num_kv_heads, head_dim), float("nan"), dtype=dtype,
                                device=device)
        free = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables = [[free.pop() for _ in range(-(-n // block_size))] for n in seq_lens]
        self.spare = free[0] if free else None
        values = torch.randn(sum(seq_lens), 2 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        self.cache.flatten(0, 1)[self.slots_all()] = values

    def slots(self, i: int) -> torch.Tensor:
        bs = self.block_size
        positions = torch.arange(self.seq_lens[i])
        return torch.tensor(self.tables[i], dtype=torch.int64)[positions // bs] * bs + positions % bs

    def slots_all(self) -> torch.Tensor:
        return torch.cat([self.slots(i) for i in range(len(self.seq_lens))]).to(self.cache.device)

    def table_tensor(self, dtype=torch.int32, pad: int = 0) -> torch.Tensor:
        """[num_seqs, max_blocks + pad]; padding entries point at a NaN block (never read)."""
        width = max(len(t) for t in self.tables) + pad
        filler = self.spare if self.spare is not None else 0
        rows = [t + [filler] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=dtype, device=self.cache.device)

    def context(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's keys and values: [kv_heads, len, head_dim] each, float32."""
        ctx = self.cache.flatten(0, 1)[self.slots(i).to(self.cache.device)].float()
        return ctx[:, : self.num_kv_heads].transpose(0, 1), ctx[:, self.num_kv_heads:].transpose(0, 1)


def decode_reference(query: torch.Tensor, paged: PagedCache) -> torch.Tensor:
    """query [num_seqs, heads, head_dim] -> [num_seqs, heads, head_dim] float32."""
    outs = []
    for i in range(query.shape[0]):
        k, v = paged.context(i)
        q = query[i].float().unsqueeze(1)
        outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], enable_gqa=True)[0, :, 0])
    return torch.stack(outs)


def prefill_reference(query: torch.Tensor, cu_seqlens: list[int], paged: PagedCache) -> torch.Tensor:
    """Chunks back to back in ``query``; chunk i is the last tokens of sequence i's context."""
    outs = []
    for i, length in enumerate(paged.seq_lens):
        q = query[cu_seqlens[i]:cu_seqlens[i + 1]].float().transpose(0, 1)
        q_len = q.shape[1]
        k, v = paged.context(i)
        mask = torch.arange(length, device=q.device)[None, :] <= (
            length - q_len + torch.arange(q_len, device=q.device))[:, None]
        outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask,
                                                   enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    return ((out.float() - ref).norm() / ref.norm()).item()


# documented bounds on rel_error per dtype (the reference in float32 from the same inputs)
ERROR_BOUND = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}
