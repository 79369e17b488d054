"""Native CPU ops against independent torch references (fresh random inputs, NaN where the
kernels must not read)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_ops
from tests.engine.avx2 import avx2_build

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
             torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.fixture(scope="module")
def ops():
    module = cpu_ops.load()
    assert module is not None, "cpu_ops must build on this machine (g++ and ninja are installed by make)"
    return module


@pytest.fixture(scope="module")
def avx2_ops(ops):
    return avx2_build("tandem_cpu_ops", cpu_ops._SOURCE, ops)


@pytest.mark.parametrize("build", ["ops", "avx2_ops"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_add_rms_norm(request, build, dtype, rows):
    ops = request.getfixturevalue(build)
    g = torch.Generator().manual_seed(rows)
    residual = torch.randn(rows, 576, generator=g).to(dtype)
    delta = torch.randn(rows, 576, generator=g).to(dtype)
    weight = torch.rand(576, generator=g).to(dtype) + 0.5
    expected_residual = residual + delta  # an eager add rounds to the dtype
    expected = F.rms_norm(expected_residual.float(), (576,), weight.float(), 1e-5)
    got_residual = residual.clone()
    got = ops.add_rms_norm_(got_residual, delta, weight, 1e-5)
    assert torch.equal(got_residual, expected_residual)  # rounded as torch rounds, bit for bit
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
    untouched = residual.clone()
    torch.testing.assert_close(ops.add_rms_norm_(untouched, None, weight, 1e-5).float(),
                               F.rms_norm(residual.float(), (576,), weight.float(), 1e-5), **TOLERANCE[dtype])
    assert torch.equal(untouched, residual)


def test_add_rms_norm_rounds_ties_and_nan_as_torch(ops):
    """The residual's rounding to bfloat16 (written on integers in the kernel): ties to even,
    either side of a power of two, infinities, and NaN (c10 stores 0x7FC0)."""
    ulp = 2.0**-8  # half a bfloat16 ulp at 1.0: exact ties
    base = torch.tensor([1.0, 1.0 + 2 * ulp, -1.0, 255.0, 3e38, float("inf"), 1.0, 0.0])
    delta = torch.tensor([ulp, ulp, -ulp, 0.5, 3e38, 1.0, float("nan"), -0.0])
    residual = base.to(torch.bfloat16).view(1, -1).contiguous()
    # float32 sum rounded once, exactly what an eager bfloat16 add computes
    expected = (residual.float() + delta.to(torch.bfloat16).float().view(1, -1)).to(torch.bfloat16)
    ops.add_rms_norm_(residual, delta.to(torch.bfloat16).view(1, -1).contiguous(),
                      torch.ones(8, dtype=torch.bfloat16), 1e-5)
    assert torch.equal(residual.view(torch.int16)[:, :6], expected.view(torch.int16)[:, :6])
    assert residual[0, 6].isnan() and residual.view(torch.int16)[0, 6] == 0x7FC0


@pytest.mark.parametrize("build", ["ops", "avx2_ops"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(7, 1536), (64, 1536), (3, 37)])  # 37: a tail past the 16-lane loop
def test_silu_mul(request, build, dtype, rows, inter):
    ops = request.getfixturevalue(build)
    g = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=g)
    gate_up[:, :inter] *= torch.linspace(0.1, 40.0, inter)  # gates far into both tails, past the exp's clamp
    gate_up = gate_up.to(dtype)
    expected = F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float()
    got = ops.silu_mul(gate_up)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
    if dtype == torch.bfloat16:  # within one bfloat16 rounding of the float32 result
        torch.testing.assert_close(got.float(), expected, rtol=2.0**-7, atol=1e-30)

@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_in_place_on_a_strided_view(ops, dtype):
    tokens, heads, rotated, head_dim = 6, 8, 5, 64  # rotate 5 of 8 heads, as q+k of a qkv tensor
    x = torch.randn(tokens, heads, head_dim).to(dtype)
    angles = torch.rand(100, head_dim // 2) * 6.3
    positions = torch.tensor([0, 3, 99, 7, 7, 50])
    cos, sin = angles.cos(), angles.sin()
    pairs = x.float().view(tokens, heads, head_dim // 2, 2)
    rotation = torch.polar(torch.ones_like(angles), angles)[positions].unsqueeze(1)  # complex reference
    expected = x.float().clone()
    expected[:, :rotated] = torch.view_as_real(torch.view_as_complex(pairs[:, :rotated].contiguous()) * rotation).flatten(-2)
    got = x.clone()
    ops.rope_(got[:, :rotated], positions, cos, sin, rotated)
    torch.testing.assert_close(got.float(), expected, **TOLERANCE[dtype])
    with pytest.raises(RuntimeError, match="outside"):
        ops.rope_(got[:, :rotated], torch.tensor([0, 1, 2, 3, 4, 100]), cos, sin, rotated)


def paged_case(dtype, heads, kv_heads, block_size, seq_lens, seed, head_dim=64):
    """Sequences of random K/V written through shuffled block tables into a NaN cache (only
    real positions are written): (query, cache, block_tables, seq_lens, keys, values)."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-length // block_size) for length in seq_lens) + 3
    cache = torch.full((num_blocks, block_size, 2 * kv_heads, head_dim), float("nan")).to(dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, next_block = [], 0
    keys, values = [], []
    for length in seq_lens:
        count = -(-length // block_size)
        table = order[next_block : next_block + count]
        next_block += count
        tables.append(table)
        k = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
        index = torch.tensor([table[pos // block_size] for pos in range(length)])
        offset = torch.arange(length) % block_size
        cache[index, offset, :kv_heads] = k
        cache[index, offset, kv_heads:] = v
        keys.append(k)
        values.append(v)
    max_blocks = max(len(t) for t in tables)
    block_tables = torch.zeros(len(tables), max_blocks, dtype=torch.int64)
    for i, table in enumerate(tables):
        block_tables[i, : len(table)] = torch.tensor(table)
    query = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    return query, cache, block_tables, torch.tensor(seq_lens), keys, values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("lengths", ["short", "long"])
@pytest.mark.parametrize("head_dim", [64, 128, 48])  # the two compiled-in head sizes, and the generic path
def test_paged_decode_attention_matches_dense_sdpa(ops, dtype, heads, kv_heads, block_size, lengths, head_dim):
    """Short contexts (one split each) and long ones (several 256-position splits, merged)."""
    seq_lens = ([1, block_size, block_size + 3, 3 * block_size - 1] if lengths == "short"
                else [300, 1, 777, 256, 257, 513])
    query, cache, block_tables, lens, keys, values = paged_case(dtype, heads, kv_heads, block_size, seq_lens,
                                                                heads * 100 + block_size, head_dim)
    out = ops.paged_decode_attention(query, cache, block_tables, lens, head_dim**-0.5)
    for i in range(len(seq_lens)):
        expected = F.scaled_dot_product_attention(
            query[i].float().unsqueeze(1),  # [heads, 1, head_dim]
            keys[i].float().transpose(0, 1),  # [kv_heads, len, head_dim]
            values[i].float().transpose(0, 1),
            enable_gqa=True,
        ).squeeze(1)
        torch.testing.assert_close(out[i].float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 48)])
def test_paged_decode_attention_built_for_avx2_matches_dense_sdpa(avx2_ops, dtype, heads, kv_heads, head_dim):
    seq_lens = [300, 1, 777, 19]
    query, cache, block_tables, lens, keys, values = paged_case(dtype, heads, kv_heads, 16, seq_lens, 11, head_dim)
    out = avx2_ops.paged_decode_attention(query, cache, block_tables, lens, head_dim**-0.5)
    for i in range(len(seq_lens)):
        expected = F.scaled_dot_product_attention(query[i].float().unsqueeze(1), keys[i].float().transpose(0, 1),
                                                  values[i].float().transpose(0, 1), enable_gqa=True).squeeze(1)
        torch.testing.assert_close(out[i].float(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_decode_attention_is_batch_and_thread_invariant(ops, threads):
    """A sequence's output is bitwise the same alone or in a batch, on 1 or 2 threads: how its
    context is cut depends on its own length only."""
    seq_lens = [700, 5, 300, 64]
    query, cache, block_tables, lens, _, _ = paged_case(torch.bfloat16, 9, 3, 16, seq_lens, 7)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = ops.paged_decode_attention(query, cache, block_tables, lens, 0.125)
        for i in range(len(seq_lens)):
            alone = ops.paged_decode_attention(query[i : i + 1], cache, block_tables[i : i + 1], lens[i : i + 1], 0.125)
            assert torch.equal(alone[0], together[i]), i
    finally:
        torch.set_num_threads(before)


def test_paged_decode_attention_validates_inputs(ops):
    cache = torch.zeros(4, 16, 2, 64)
    query = torch.zeros(1, 2, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_decode_attention(query, cache, torch.tensor([[7]]), torch.tensor([3]), 0.125)
    with pytest.raises(RuntimeError, match="bad seq_len"):
        ops.paged_decode_attention(query, cache, torch.tensor([[0]]), torch.tensor([17]), 0.125)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_a_float64_product_and_rows_do_not_interact(ops, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    weight = torch.randn(1536, 576, generator=g)
    bias = torch.randn(1536, generator=g) if with_bias else None
    got = ops.skinny_linear_f32(x, weight, bias)
    expected = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)
    # each row alone gives the same bits: a decode's logits do not depend on its batch-mates
    for r in range(rows):
        assert torch.equal(ops.skinny_linear_f32(x[r:r + 1].contiguous(), weight, bias)[0], got[r])


def test_skinny_linear_validates_inputs(ops):
    x, weight = torch.randn(2, 64), torch.randn(32, 64)
    for bad_x, bad_w, match in [(x.double(), weight, "float32 x"), (x.T, torch.randn(32, 2), "contiguous float32 x"),
                                (x, weight[:, :32], "matching x"), (torch.randn(17, 64), weight, "1 to 16 rows")]:
        with pytest.raises(RuntimeError, match=match):
            ops.skinny_linear_f32(bad_x, bad_w, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.skinny_linear_f32(x, weight, torch.randn(31))


def test_float32_linear_layers_use_the_skinny_kernel_for_decode_batches_only(ops, monkeypatch):
    from engine.models import linear as linear_module
    from engine.models.linear import Linear

    layer = Linear(64, 32, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.pack()
    calls = []
    real = ops.skinny_linear_f32
    monkeypatch.setattr(layer, "_skinny", type("Spy", (), {
        "skinny_linear_f32": staticmethod(lambda *a: calls.append(a[0].shape[0]) or real(*a))})())
    for rows in (1, linear_module.SKINNY_MAX_ROWS, linear_module.SKINNY_MAX_ROWS + 1, 40):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, linear_module.SKINNY_MAX_ROWS]
