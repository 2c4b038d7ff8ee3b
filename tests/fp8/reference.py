"""An independent, loop-per-block statement of TE Float8BlockScaling's quantization, the
reference the vectorized emulation in titan_core.fp8 is checked against."""

from __future__ import annotations

import math

import torch


def ref_scale(amax: torch.Tensor, dtype: torch.dtype, power_2: bool) -> torch.Tensor:
    """fp32 multiplier for one block: fmax / amax, rounded down to a power of two."""
    if amax.item() == 0.0:
        return torch.tensor(1.0)
    scale = torch.tensor(torch.finfo(dtype).max, dtype=torch.float32) / amax.float()
    if power_2:
        mantissa, exponent = math.frexp(scale.item())
        scale = torch.tensor(2.0 ** (exponent - 1), dtype=torch.float32)
    return scale


def ref_fake_quant(
    x: torch.Tensor, rows: int, cols: int, dtype: torch.dtype, power_2: bool = True
) -> torch.Tensor:
    """x after quantize + dequantize, block by block (fp32)."""
    x = x.float()
    out = torch.empty_like(x)
    fmax = torch.finfo(dtype).max
    for i in range(0, x.shape[0], rows):
        for j in range(0, x.shape[1], cols):
            block = x[i : i + rows, j : j + cols]
            scale = ref_scale(block.abs().max(), dtype, power_2)
            q = (block * scale).clamp(-fmax, fmax).to(dtype).float()
            out[i : i + rows, j : j + cols] = q * (1.0 / scale)
    return out


def ref_forward(x: torch.Tensor, w: torch.Tensor, fwd: torch.dtype, p2: bool) -> torch.Tensor:
    """y = Q_1x128(x) @ Q_128x128(W)^T in float64."""
    return (
        ref_fake_quant(x, 1, 128, fwd, p2).double()
        @ ref_fake_quant(w, 128, 128, fwd, p2).double().t()
    )


def ref_grads(
    x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, fwd: torch.dtype, bwd: torch.dtype, p2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """dgrad = Q_1x128(g) @ Q_128x128(W); wgrad = Q_tok(g)^T @ Q_tok(x), both operands in
    1x128 tiles along the token dim."""
    wq = ref_fake_quant(w, 128, 128, fwd, p2).double()
    dx = ref_fake_quant(g, 1, 128, bwd, p2).double() @ wq
    g_tok = ref_fake_quant(g.t(), 1, 128, bwd, p2).double()  # [N, T]
    x_tok = ref_fake_quant(x.t(), 1, 128, fwd, p2).double()  # [K, T]
    return dx, g_tok @ x_tok.t()
