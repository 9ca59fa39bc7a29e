"""Block-wise FP8 quantization: layout, per-block scales and the documented error bound."""

import pytest
import torch

from megatron_rl.checkpoint.fp8 import (
    BLOCK,
    E4M3_MAX,
    dequantize_blockwise,
    error_bound,
    quantize_blockwise,
)


def _varied_weight(rows: int, cols: int) -> torch.Tensor:
    """Random weight whose magnitude spans 5 decades across blocks, with exact zeros."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(rows, cols, generator=gen)
    weight *= torch.logspace(-3, 2, rows)[:, None] * torch.logspace(0, -1, cols)[None, :]
    weight[::7, ::5] = 0.0
    return weight


def test_layout_matches_deepseek_v3():
    quantized, scale_inv = quantize_blockwise(_varied_weight(300, 200))
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == (300, 200)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (3, 2)  # ceil(300/128), ceil(200/128)
    assert BLOCK == 128


def test_dequantized_weights_meet_the_bound_and_the_bound_is_tight():
    weight = _varied_weight(300, 200)
    quantized, scale_inv = quantize_blockwise(weight)
    err = (dequantize_blockwise(quantized, scale_inv).double() - weight.double()).abs()
    ratio = err / error_bound(weight, scale_inv)
    assert ratio.max() <= 1.0
    assert ratio.max() > 0.9  # a half-ulp bound: some element rounds by nearly half a step


def test_each_block_maps_its_largest_entry_to_448():
    weight = _varied_weight(256, 256)
    quantized, scale_inv = quantize_blockwise(weight)
    blocks = quantized.float().abs().view(2, BLOCK, 2, BLOCK).amax(dim=(1, 3))
    assert torch.equal(blocks, torch.full((2, 2), E4M3_MAX))
    amax = weight.abs().view(2, BLOCK, 2, BLOCK).amax(dim=(1, 3))
    assert torch.equal(scale_inv, amax / E4M3_MAX)


def test_scales_belong_to_their_own_block():
    """A transposed (or otherwise misplaced) scale grid breaks the bound."""
    weight = torch.full((256, 256), 1e-3)
    weight[:BLOCK, BLOCK:] = 1e3
    quantized, scale_inv = quantize_blockwise(weight)
    good = dequantize_blockwise(quantized, scale_inv)
    assert ((good - weight).abs() <= error_bound(weight, scale_inv)).all()
    wrong = dequantize_blockwise(quantized, scale_inv.t().contiguous())
    assert not ((wrong - weight).abs() <= error_bound(weight, scale_inv)).all()


def test_values_in_the_subnormal_range_need_the_absolute_term():
    weight = torch.zeros(4, 4)
    weight[0, 0] = 448.0  # scale 1: the block is quantized as is
    weight[1, 1] = 1e-3  # below 2^-6: e4m3 subnormal, spacing 2^-9
    quantized, scale_inv = quantize_blockwise(weight)
    assert float(scale_inv) == 1.0
    err = float((dequantize_blockwise(quantized, scale_inv) - weight).abs()[1, 1])
    assert 2.0**-4 * 1e-3 < err <= 2.0**-10


def test_all_zero_weight_stays_zero_with_finite_scales():
    quantized, scale_inv = quantize_blockwise(torch.zeros(130, 3))
    assert torch.isfinite(scale_inv).all() and scale_inv.shape == (2, 1)
    assert torch.equal(dequantize_blockwise(quantized, scale_inv), torch.zeros(130, 3))


def test_bfloat16_input_and_shape_checks():
    weight = _varied_weight(129, 64).to(torch.bfloat16)
    quantized, scale_inv = quantize_blockwise(weight)
    err = (dequantize_blockwise(quantized, scale_inv).double() - weight.double()).abs()
    assert (err <= error_bound(weight, scale_inv)).all()
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.zeros(4))
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_blockwise(quantized, scale_inv[:1])
