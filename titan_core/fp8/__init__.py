"""Blockwise FP8 (DeepSeek-V3 / Transformer Engine ``Float8BlockScaling``) emulated in plain
torch: the numerical reference of ``train.fp8_recipe=blockwise``, and how ``train.fp8`` runs
on CPU. See :mod:`titan_core.fp8.quantize` for the scale rule and
:mod:`titan_core.fp8.linear` for how each GEMM's operands are tiled."""

from titan_core.fp8.linear import BlockwiseFp8Linear, fp8_linear
from titan_core.fp8.quantize import (
    BLOCK,
    BlockQuantized,
    quantize_blocks,
    quantize_tiles,
    quantize_weight,
)
from titan_core.fp8.recipe import BlockwiseRecipe, cpu_emulation

__all__ = [
    "BLOCK",
    "BlockQuantized",
    "BlockwiseFp8Linear",
    "BlockwiseRecipe",
    "cpu_emulation",
    "fp8_linear",
    "quantize_blocks",
    "quantize_tiles",
    "quantize_weight",
]
