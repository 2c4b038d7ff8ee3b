"""The emulated blockwise FP8 linear GEMM: ``y = x @ W^T`` with TE ``Float8BlockScaling``'s
quantization of each GEMM's operands, computed in fp32 on the dequantized values.

- forward  ``y = x W^T``: x in 1x128 tiles along K (its rows), W in 128x128 blocks.
- dgrad   ``dx = dy W``: dy in 1x128 tiles along N (its rows), W in the same 128x128 blocks.
- wgrad   ``dW = dy^T x``: both in 1x128 tiles along the token dim (TE's columnwise copies,
  quantized from the high-precision tensors, never from the rowwise FP8 ones).

Every GEMM reduces over whole tiles of both operands, as the FP8 tensor cores do.
"""

from __future__ import annotations

from typing import Any

import torch

from titan_core.fp8.quantize import quantize_tiles, quantize_weight
from titan_core.fp8.recipe import BlockwiseRecipe


def _dequantized_weight(w: torch.Tensor, r: BlockwiseRecipe) -> torch.Tensor:
    """W in 128x128 blocks; forward and dgrad share it (2-D blocks are transpose-invariant)."""
    return quantize_weight(w, r.forward_dtype, r.power_2_scale).dequantize()


def _fp8_gemm_wgrad(g: torch.Tensor, x: torch.Tensor, r: BlockwiseRecipe) -> torch.Tensor:
    gq = quantize_tiles(g.t(), r.backward_dtype, r.power_2_scale).dequantize()  # [N, T]
    xq = quantize_tiles(x.t(), r.forward_dtype, r.power_2_scale).dequantize()  # [K, T]
    return gq @ xq.t()


class BlockwiseFp8Linear(torch.autograd.Function):
    """``x [T, K] @ weight [N, K]^T`` with emulated blockwise FP8 forward, dgrad and wgrad.

    Saved for backward: ``x`` (its token-dim tiles are quantized for wgrad from it, as TE's
    columnwise copy is) and the dequantized weight blocks."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, recipe: BlockwiseRecipe
    ) -> torch.Tensor:
        wq = _dequantized_weight(weight, recipe)
        xq = quantize_tiles(x, recipe.forward_dtype, recipe.power_2_scale).dequantize()
        ctx.save_for_backward(x, wq)
        ctx.recipe = recipe
        ctx.weight_dtype = weight.dtype
        return (xq @ wq.t()).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, wq = ctx.saved_tensors
        r: BlockwiseRecipe = ctx.recipe
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq = quantize_tiles(grad, r.backward_dtype, r.power_2_scale).dequantize()
            dx = (gq @ wq).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = _fp8_gemm_wgrad(grad, x, r).to(ctx.weight_dtype)
        return dx, dw, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    recipe: BlockwiseRecipe,
) -> torch.Tensor:
    """``torch.nn.functional.linear`` through :class:`BlockwiseFp8Linear`; any leading dims."""
    lead = x.shape[:-1]
    y = BlockwiseFp8Linear.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    y = y.view(*lead, weight.shape[0])
    return y + bias if bias is not None else y
