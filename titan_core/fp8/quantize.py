"""Blockwise FP8 quantization in plain torch, as Transformer Engine's ``Float8BlockScaling``.

A 2-D tensor is cut into ``rows x cols`` blocks (1x128 tiles for activations and gradients,
128x128 blocks for weights); a block whose edge passes the tensor's is zero-padded, which
leaves its amax unchanged. Each block gets one fp32 scale from its own amax:

    scale = fmax / amax           (the multiplier; 1 when amax is 0 or inf)
    scale = 2 ** floor(log2(scale))   when ``power_2_scale`` (TE's default)
    q = cast_fp8(clamp(x * scale, -fmax, fmax)),   x ~= q * scale_inv,  scale_inv = 1 / scale

``fmax`` is the format's largest finite value (448 for e4m3, 57344 for e5m2). With
``power_2_scale`` off, ``scale_inv`` is amax / fmax up to fp32 rounding (TE with
``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

#: TE's block edge for Float8BlockScaling.
BLOCK = 128


@dataclass(frozen=True)
class BlockQuantized:
    """An FP8 tensor with one fp32 ``scale_inv`` per block; ``data`` is padded to whole
    blocks, ``shape`` is the original (unpadded) shape."""

    data: torch.Tensor  # [R_pad, C_pad], float8
    scale_inv: torch.Tensor  # [R_pad // rows, C_pad // cols], fp32
    rows: int
    cols: int
    shape: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor the FP8 GEMM sees: ``data * scale_inv`` per block, cropped."""
        nr, nc = self.scale_inv.shape
        blocks = to_float32(self.data).view(nr, self.rows, nc, self.cols)
        full = (blocks * self.scale_inv[:, None, :, None]).view(nr * self.rows, nc * self.cols)
        return full[: self.shape[0], : self.shape[1]].to(dtype)


@functools.cache
def _decode_table(dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value of each of the 256 bit patterns of ``dtype``, by torch's own cast."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float32)


def to_float32(data: torch.Tensor) -> torch.Tensor:
    """``data.to(float32)`` for an FP8 tensor through a 256-entry table: the same values,
    without torch's per-element CPU conversion (10x slower than the GEMM it feeds)."""
    table = _decode_table(data.dtype).to(data.device)
    return table[data.view(torch.uint8).to(torch.int32)]


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def block_scales(amax: torch.Tensor, dtype: torch.dtype, power_2_scale: bool) -> torch.Tensor:
    """The multiplier ``scale`` from fp32 ``amax`` (TE's rule; see the module docstring)."""
    amax = amax.to(torch.float32)
    fmax = fp8_max(dtype)
    degenerate = (amax == 0) | torch.isinf(amax)
    # true fp32 division, as TE's kernel (torch's scalar / tensor multiplies by a reciprocal)
    scale = torch.where(degenerate, torch.ones_like(amax), torch.full_like(amax, fmax) / amax)
    # fmax / (a subnormal amax) overflows: TE clamps it to the largest fp32.
    scale = torch.nan_to_num(scale, posinf=torch.finfo(torch.float32).max)
    if power_2_scale:
        # scale = mantissa * 2**exponent with mantissa in [0.5, 1): keep 2**(exponent - 1)
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    return scale


def quantize_blocks(
    x: torch.Tensor,
    rows: int,
    cols: int,
    dtype: torch.dtype = torch.float8_e4m3fn,
    power_2_scale: bool = True,
) -> BlockQuantized:
    """Quantize 2-D ``x`` in ``rows x cols`` blocks to ``dtype`` with per-block fp32 scales."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks takes a 2-D tensor, got shape {tuple(x.shape)}")
    r, c = x.shape
    nr, nc = -(-r // rows), -(-c // cols)
    x = x.to(torch.float32).contiguous()
    padded = torch.nn.functional.pad(x, (0, nc * cols - c, 0, nr * rows - r))
    blocks = padded.view(nr, rows, nc, cols)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = block_scales(amax, dtype, power_2_scale)
    fmax = fp8_max(dtype)
    scaled = (blocks * scale[:, None, :, None]).clamp(-fmax, fmax)
    data = scaled.to(dtype).view(nr * rows, nc * cols)
    return BlockQuantized(data, torch.reciprocal(scale), rows, cols, (r, c))


def quantize_tiles(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = True
) -> BlockQuantized:
    """1x128 tiles along the last dim (activations, gradients)."""
    return quantize_blocks(x, 1, BLOCK, dtype, power_2_scale)


def quantize_weight(
    w: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn, power_2_scale: bool = True
) -> BlockQuantized:
    """128x128 blocks (weights)."""
    return quantize_blocks(w, BLOCK, BLOCK, dtype, power_2_scale)
