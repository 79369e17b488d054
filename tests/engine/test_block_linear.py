"""Weights kept as exact 4- and 8-bit blocks (engine/kernels/block_linear.py): the blocks are
found only where they give back every element bit for bit (weights made by gguf's own
quantizer and dequantizer, the independent reference), the matmul on them matches a float64
product of the float32 weight in the native and the AVX2 build, and the default model's
float32 layers all decode through them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.kernels import block_linear
from engine.models.linear import BLOCK_MAX_ROWS, Linear
from tests.engine.avx2 import avx2_build

KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def gguf_weight(kind: str, rows: int, cols: int, seed: int, offset: float = 0.0) -> torch.Tensor:
    """A float32 weight as a GGUF checkpoint holds it once dequantized: gguf's quantizer, then
    its dequantizer."""
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05 + offset
    return torch.from_numpy(dequantize(quantize(data, KINDS[kind]), KINDS[kind]).astype(np.float32).copy())


@pytest.fixture(scope="module")
def native():
    module = block_linear.load()
    assert module is not None, "block_linear did not build"
    return module


@pytest.fixture(scope="module")
def avx2(native):
    return avx2_build("tandem_block_linear", block_linear._SOURCE, native)


def unpacked(blocks: block_linear.Blocks, cols: int) -> torch.Tensor:
    """The float32 weight the blocks stand for, rebuilt in torch (q * d + m, one rounding)."""
    if blocks.kind == "q8_0":
        qs, d = blocks.tensors
        return (qs.float().view(qs.shape[0], -1, 32) * d.unsqueeze(-1)).reshape(qs.shape[0], cols)
    qs, d, m = blocks.tensors
    q = torch.cat([qs.view(qs.shape[0], -1, 16) & 15, qs.view(qs.shape[0], -1, 16) >> 4], dim=-1).float()
    return (q * d.unsqueeze(-1) + m.unsqueeze(-1)).reshape(qs.shape[0], cols)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("offset", [0.0, 3.0])  # 3.0: every block's minimum far from zero
def test_the_blocks_of_a_gguf_weight_give_back_every_element(native, kind, offset):
    weight = gguf_weight(kind, 96, 576, seed=1, offset=offset)
    blocks = block_linear.pack(weight, native)
    assert blocks is not None and blocks.kind == kind
    assert torch.equal(unpacked(blocks, 576), weight)
    scales = weight.numel() // 32 * 4 * (2 if kind == "q4_1" else 1)  # float32 d (and m) a block
    assert blocks.nbytes == weight.numel() // (2 if kind == "q4_1" else 1) + scales


def test_a_weight_that_is_not_exact_blocks_is_left_alone(native):
    weight = gguf_weight("q4_1", 64, 576, seed=2)
    nudged = weight.clone()
    nudged[63, 575] = torch.nextafter(nudged[63, 575], torch.tensor(1.0))  # one element off by one ulp
    assert block_linear.pack(nudged, native) is None
    assert block_linear.pack(torch.randn(64, 576), native) is None
    assert block_linear.pack(gguf_weight("q4_1", 64, 576, seed=2)[:, :560].contiguous(), native) is None  # K % 32
    with_nan = weight.clone()
    with_nan[0, 0] = float("nan")
    assert block_linear.pack(with_nan, native) is None


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 17, 33])
def test_the_matmul_on_blocks_matches_a_float64_product(request, build, kind, rows):
    module = request.getfixturevalue(build)
    weight = gguf_weight(kind, 200, 1536, seed=rows)
    bias = torch.randn(200, generator=torch.Generator().manual_seed(rows))
    blocks = block_linear.pack(weight, module)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(100 + rows))
    expected = x.double() @ weight.double().T + bias.double()
    for with_bias in (True, False):
        got = blocks.linear(x, bias if with_bias else None)
        assert got.dtype == torch.float32 and got.shape == (rows, 200)
        torch.testing.assert_close(got.double(), expected if with_bias else expected - bias.double(),
                                   rtol=1e-5, atol=1e-5)


def test_bad_arguments_are_refused(native):
    blocks = block_linear.pack(gguf_weight("q4_1", 32, 64, seed=3), native)
    with pytest.raises(RuntimeError, match="x"):
        blocks.linear(torch.randn(2, 96), None)  # the wrong width
    with pytest.raises(RuntimeError, match="bias"):
        blocks.linear(torch.randn(2, 64), torch.randn(31))


def test_a_layer_multiplies_by_its_blocks_up_to_the_bound_and_by_the_float32_weight_above(monkeypatch):
    layer = Linear(576, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(gguf_weight("q4_1", 64, 576, seed=4))
    layer.pack()
    assert layer._blocks is not None and layer.weight_nbytes == layer._blocks.nbytes
    calls = []
    monkeypatch.setattr(block_linear.Blocks, "linear", lambda self, x, bias: calls.append(len(x)) or
                        torch.zeros(len(x), 64))
    with torch.inference_mode():
        layer(torch.randn(BLOCK_MAX_ROWS, 576))
        full = layer(torch.randn(BLOCK_MAX_ROWS + 1, 576))
    assert calls == [BLOCK_MAX_ROWS] and full.abs().sum() > 0


def test_the_default_models_float32_weights_decode_through_their_blocks(llm, monkeypatch):
    """SmolLM2 comes as a Q4_1 GGUF (its output head Q8_0): every matmul of the float32 engine
    has its blocks; TANDEM_EXACT_BLOCKS=0 leaves a weight as float32."""
    model = llm.engine_core.model
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    kinds = {m._blocks.kind if m._blocks is not None else None for m in layers}
    assert kinds == {"q4_1", "q8_0"} and model.lm_head._blocks.kind == "q8_0"
    monkeypatch.setenv("TANDEM_EXACT_BLOCKS", "0")
    assert block_linear.pack(model.lm_head.weight) is None
