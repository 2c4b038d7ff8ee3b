"""The emulated blockwise FP8 linear GEMM against an independent reference of the same
quantization, and against unquantized fp32."""

from __future__ import annotations

import pytest
import torch

from tests.fp8.reference import ref_fake_quant, ref_forward, ref_grads
from titan_core.fp8 import BlockwiseFp8Linear, BlockwiseRecipe, fp8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = [
    BlockwiseRecipe(),
    BlockwiseRecipe(power_2_scale=False),
    BlockwiseRecipe(backward_dtype=E5M2),  # train.fp8=hybrid
]


def _operands(seed: int, t: int = 200, k: int = 300, n: int = 150):
    """Shapes that are not multiples of 128 (the last tile and block are padded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 3
    w = torch.randn(n, k, generator=g) * 0.02
    grad = torch.randn(t, n, generator=g) * 1e-3
    return x, w, grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("recipe", RECIPES)
def test_forward_equals_the_reference_quantization(recipe):
    x, w, _ = _operands(seed=0)
    y = BlockwiseFp8Linear.apply(x, w, recipe)
    ref = ref_forward(x, w, recipe.forward_dtype, recipe.power_2_scale)
    # same quantized operands: only fp32 accumulation differs from the float64 reference
    assert _rel(y, ref) < 1e-6
    # against the unquantized GEMM: e4m3's 3 mantissa bits, about 1e-2
    assert 1e-3 < _rel(y, x @ w.t()) < 5e-2


@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_equal_the_reference_quantization(recipe):
    x, w, grad = _operands(seed=1)
    x.requires_grad_(True)
    w.requires_grad_(True)
    BlockwiseFp8Linear.apply(x, w, recipe).backward(grad)
    dx, dw = ref_grads(
        x.detach(), w.detach(), grad, recipe.forward_dtype, recipe.backward_dtype,
        recipe.power_2_scale,
    )  # fmt: skip
    assert _rel(x.grad, dx) < 1e-6
    assert _rel(w.grad, dw) < 1e-6
    coarse = 1e-1 if recipe.backward_dtype == E5M2 else 5e-2
    assert 1e-3 < _rel(x.grad, grad @ w.detach()) < coarse
    assert 1e-3 < _rel(w.grad, grad.t() @ x.detach()) < coarse


def test_wgrad_tiles_run_along_tokens_not_features():
    """wgrad reduces over tokens, so both operands are tiled along tokens (TE's columnwise
    copies); tiling them along features (the dgrad / forward tiles) gives another result."""
    x, w, grad = _operands(seed=2, t=256, k=128, n=128)
    loud = grad.clone()
    loud[0] *= 1e6  # token 0 sets the scale of every token-dim tile it is in ...
    x[0] = 0  # ... but adds nothing to dW itself
    _, dw_tokens = ref_grads(x, w, loud, E4M3, E4M3, True)
    dw_features = (
        ref_fake_quant(loud, 1, 128, E4M3).double().t() @ ref_fake_quant(x, 1, 128, E4M3).double()
    )
    w1 = w.clone().requires_grad_(True)
    BlockwiseFp8Linear.apply(x, w1, BlockwiseRecipe()).backward(loud)
    assert _rel(w1.grad, dw_tokens) < 1e-6
    assert _rel(w1.grad, dw_features) > 1e-1


def test_fp8_linear_keeps_leading_dims_bias_and_dtype():
    x, w, _ = _operands(seed=3, t=24, k=256, n=128)
    x3 = x.view(6, 4, 256).to(torch.bfloat16).requires_grad_(True)
    wb = w.to(torch.bfloat16).requires_grad_(True)
    bias = torch.ones(128, dtype=torch.bfloat16, requires_grad=True)
    y = fp8_linear(x3, wb, bias, BlockwiseRecipe())
    assert y.shape == (6, 4, 128) and y.dtype == torch.bfloat16
    flat = BlockwiseFp8Linear.apply(x3.detach().reshape(24, 256), wb.detach(), BlockwiseRecipe())
    assert torch.equal(y.detach().view(24, 128), flat + 1)
    y.sum().backward()
    assert x3.grad.dtype == wb.grad.dtype == torch.bfloat16
    assert torch.equal(bias.grad, torch.full((128,), 24.0, dtype=torch.bfloat16))
