"""Blockwise FP8 quantize / dequantize: tiles, padding, the scale rule, round-trip bounds."""

from __future__ import annotations

import pytest
import torch

from tests.fp8.reference import ref_fake_quant
from titan_core.fp8 import BLOCK, quantize_blocks, quantize_tiles, quantize_weight

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2]


def _spread(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random values whose magnitude varies by orders of magnitude across rows and columns."""
    g = torch.Generator().manual_seed(seed)
    rows = 10 ** torch.empty(shape[0], 1).uniform_(-4, 3, generator=g)
    cols = 10 ** torch.empty(1, shape[1]).uniform_(-1, 1, generator=g)
    return torch.randn(shape, generator=g) * rows * cols


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("power_2", [True, False])
@pytest.mark.parametrize("rows,cols", [(1, BLOCK), (BLOCK, BLOCK)])
def test_round_trip_error_is_within_half_an_fp8_ulp(dtype, power_2, rows, cols):
    x = _spread((261, 300), seed=rows + cols)
    q = quantize_blocks(x, rows, cols, dtype, power_2)
    back = q.dequantize()
    fi = torch.finfo(dtype)
    # per element: half an ulp of the format, relative; in the subnormal range, half the
    # subnormal spacing, in the block's own units (scale_inv)
    scale_inv = q.scale_inv.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    scale_inv = scale_inv[: x.shape[0], : x.shape[1]]
    bound = fi.eps / 2 * x.abs() + fi.smallest_normal * fi.eps / 2 * scale_inv
    assert torch.all((back - x).abs() <= bound * (1 + 1e-6))
    rel = ((back - x).norm() / x.norm()).item()
    assert 1e-4 < rel < fi.eps  # quantized, and about as coarse as the format


@pytest.mark.parametrize("dtype", FORMATS)
def test_scales_follow_the_amax_rule(dtype):
    x = _spread((3, 2 * BLOCK + 5), seed=1)
    fmax = torch.finfo(dtype).max
    q2 = quantize_tiles(x, dtype, power_2_scale=True)
    q32 = quantize_tiles(x, dtype, power_2_scale=False)
    assert q2.scale_inv.shape == (3, 3) and q2.data.shape == (3, 3 * BLOCK)
    amax = torch.nn.functional.pad(x, (0, BLOCK - 5)).view(3, 3, BLOCK).abs().amax(-1)
    # fp32 scales: scale_inv = amax / fmax (up to fp32 rounding)
    torch.testing.assert_close(q32.scale_inv, amax / fmax, rtol=1e-6, atol=0)
    # power-of-2 scales: the largest power of two not above fmax / amax
    log2 = torch.log2(q2.scale_inv)
    assert torch.equal(log2, log2.round())
    assert torch.all(amax / q2.scale_inv <= fmax) and torch.all(amax / q2.scale_inv > fmax / 2)


def test_padding_leaves_amax_alone_and_zero_blocks_get_unit_scale():
    w = torch.zeros(130, 200)
    w[:128, :128] = torch.randn(128, 128)
    q = quantize_weight(w)
    assert q.scale_inv.shape == (2, 2) and q.data.shape == (256, 256)
    assert torch.equal(q.scale_inv[1], torch.ones(2)) and q.scale_inv[0, 1] == 1
    assert torch.equal(q.dequantize()[:, 128:], torch.zeros(130, 72))
    assert q.dequantize().shape == (130, 200)


def test_each_block_is_scaled_on_its_own():
    w = torch.randn(256, 256)
    loud = w.clone()
    loud[:128, 128:] *= 1000  # one 128x128 block
    a, b = quantize_weight(w).dequantize(), quantize_weight(loud).dequantize()
    same = torch.ones(256, 256, dtype=torch.bool)
    same[:128, 128:] = False
    assert torch.equal(a[same], b[same])
    x = torch.randn(4, 300)
    loud_x = x.clone()
    loud_x[2, 128:256] *= 1000  # one 1x128 tile
    a, b = quantize_tiles(x).dequantize(), quantize_tiles(loud_x).dequantize()
    assert torch.equal(a[:2], b[:2]) and torch.equal(a[2, :128], b[2, :128])
    assert not torch.equal(a[2, 128:256], b[2, 128:256] / 1000)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("power_2", [True, False])
def test_matches_the_block_by_block_reference(dtype, power_2):
    x = _spread((140, 270), seed=7)
    for rows, cols in [(1, BLOCK), (BLOCK, BLOCK)]:
        got = quantize_blocks(x, rows, cols, dtype, power_2).dequantize()
        assert torch.equal(got, ref_fake_quant(x, rows, cols, dtype, power_2))


def test_input_dtype_does_not_matter_beyond_its_values():
    x = torch.randn(8, 200).to(torch.bfloat16)
    assert torch.equal(quantize_tiles(x).dequantize(), quantize_tiles(x.float()).dequantize())
    assert quantize_tiles(x).dequantize(torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="2-D"):
        quantize_tiles(torch.ones(2, 3, 4))
