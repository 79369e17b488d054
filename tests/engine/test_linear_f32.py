"""float32 matmuls: the skinny kernel up to SKINNY_MAX_ROWS rows, then oneDNN with a packed
weight where it is faster on this CPU, else torch's default; every path against a float64
product, on every machine whatever it chose."""

from __future__ import annotations

import pytest
import torch

from engine.models import linear
from engine.models.linear import Linear

ROWS = (1, linear.SKINNY_MAX_ROWS, linear.SKINNY_MAX_ROWS + 1, 16, 64, 300)


def _layer(with_bias: bool) -> tuple[Linear, torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(3)
    layer = Linear(576, 960, bias=with_bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(960, 576, generator=generator))
        if with_bias:
            layer.bias.copy_(torch.randn(960, generator=generator))
    bias = layer.bias.detach().double() if with_bias else None
    return layer, layer.weight.detach().double().clone(), bias


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ weight.T
    return out if bias is None else out + bias


@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_packed_float32_matches_a_float64_product(with_bias):
    layer, weight, bias = _layer(with_bias)
    layer.pack_onednn_f32()
    layer._skinny = None  # every row count through oneDNN
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            got = layer(x)
        assert got.dtype == torch.float32 and got.shape == (rows, 960)
        torch.testing.assert_close(got.double(), _reference(x, weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("faster", [True, False])
def test_pack_follows_the_measured_choice_and_every_row_count_agrees(monkeypatch, faster):
    monkeypatch.setattr(linear, "onednn_f32_faster", lambda: faster)
    layer, weight, bias = _layer(True)
    layer.pack()
    assert (layer._packed is not None) == faster
    assert layer.weight.shape == (960, 576)  # kept: the skinny kernel and tied embeddings read it
    for rows in ROWS:
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            torch.testing.assert_close(layer(x).double(), _reference(x, weight, bias), rtol=1e-4, atol=1e-4)


def test_the_choice_is_a_measurement_made_once():
    first = linear.onednn_f32_faster()
    assert isinstance(first, bool) and linear.onednn_f32_faster() is first
    assert linear.onednn_f32_faster.cache_info().hits >= 1
