"""Native CPU kernels against plain float32 torch on the same bfloat16 values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_gemv
from engine.models.linear import Linear

pytestmark = pytest.mark.skipif(
    not cpu_gemv.cpu_supports_avx512_bf16(), reason="this CPU has no AVX-512 BF16 (the kernel is not used here)"
)


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("in_features, out_features", [(576, 1539), (100, 7), (32, 64), (1536, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_bf16_matches_float32_reference(batch, in_features, out_features, with_bias):
    module = cpu_gemv.load()
    assert module is not None, "the kernel must build on a CPU that supports it"
    generator = torch.Generator().manual_seed(batch * 1000 + in_features + out_features)
    x = torch.randn(batch, in_features, generator=generator).to(torch.bfloat16)
    w = torch.randn(out_features, in_features, generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    got = module.gemv_bf16(x, w, b)
    ref = _reference(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (batch, out_features)
    # the only rounding beyond float32 accumulation is the bfloat16 output (8-bit mantissa)
    torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-2)
    as_float = module.gemv_bf16(x, w, b, True)  # float32 out: only summation order differs
    assert as_float.dtype == torch.float32
    torch.testing.assert_close(as_float, ref, rtol=1e-5, atol=1e-4)


def test_gemv_bf16_rejects_bad_shapes():
    module = cpu_gemv.load()
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="K mismatch"):
        module.gemv_bf16(x, torch.randn(8, 32).to(torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bfloat16 only"):
        module.gemv_bf16(x.float(), torch.randn(8, 64), None)
    with pytest.raises(RuntimeError, match="batch must be"):
        module.gemv_bf16(torch.randn(9, 64).to(torch.bfloat16), torch.randn(8, 64).to(torch.bfloat16), None)


def _bf16_layer() -> tuple[Linear, torch.Tensor, torch.Tensor]:
    """A bfloat16 layer of random weights, packed, and its weight and bias as they were."""
    layer = Linear(576, 960, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576))
        layer.bias.copy_(torch.randn(960))
    layer = layer.to(torch.bfloat16)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.pack()
    return layer, w, b


def test_linear_dispatches_by_rows_and_agrees():
    layer, w, b = _bf16_layer()
    assert layer._gemv is not None and layer._packed is not None
    for rows in (1, cpu_gemv.MAX_BATCH, cpu_gemv.MAX_BATCH + 1, 64):  # native kernel, then oneDNN
        x = torch.randn(rows, 576).to(torch.bfloat16)
        torch.testing.assert_close(layer(x).float(), _reference(x, w, b), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("mid", [True, False])
def test_bf16_rows_just_above_the_mid_pack_size_use_that_copy_where_it_was_measured_faster(monkeypatch, mid):
    from engine.models import linear

    monkeypatch.setattr(linear, "onednn_bf16_mid_pack_faster", lambda: mid)
    layer, w, b = _bf16_layer()
    assert (layer._packed_mid is not None) == mid
    served = []
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, packed, *args):
        served.append((x.shape[0], "mid" if packed is layer._packed_mid else "one" if packed is layer._packed else "?"))
        return real(x, packed, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    edges = (linear.BF16_MID_PACK_ROWS, linear.BF16_MID_PACK_ROWS + 1, linear.BF16_MID_MAX_ROWS,
             linear.BF16_MID_MAX_ROWS + 1)
    for rows in edges:
        x = torch.randn(rows, 576).to(torch.bfloat16)
        torch.testing.assert_close(layer(x).float(), _reference(x, w, b), rtol=2**-7, atol=1e-2)
    inside = "mid" if mid else "one"
    assert served == [(edges[0], "one"), (edges[1], inside), (edges[2], inside), (edges[3], "one")]


def test_the_mid_pack_choice_is_a_measurement_made_once_unless_switched_off(monkeypatch):
    from engine.models import linear

    first = linear.onednn_bf16_mid_pack_faster()
    assert isinstance(first, bool) and linear.onednn_bf16_mid_pack_faster() is first
    assert linear.onednn_bf16_mid_pack_faster.cache_info().hits >= 1
    monkeypatch.setenv("TANDEM_ONEDNN_MID_PACK", "0")
    linear.onednn_bf16_mid_pack_faster.cache_clear()
    try:
        assert linear.onednn_bf16_mid_pack_faster() is False
    finally:
        linear.onednn_bf16_mid_pack_faster.cache_clear()
