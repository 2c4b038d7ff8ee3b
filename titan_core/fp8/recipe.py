"""The emulated blockwise recipe and when it is chosen (``train.fp8`` on CPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from titan_core.accelerator import Accelerator
from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import PretrainConfig

#: Transformer Engine's switch from power-of-2 to plain fp32 block scales; honoured here too
#: so the CPU reference quantizes as TE would in the same environment.
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


@dataclass(frozen=True)
class BlockwiseRecipe:
    """TE ``Float8BlockScaling``'s defaults: inputs and gradients in 1x128 tiles, weights in
    128x128 blocks, e4m3 everywhere (``hybrid``: gradients e5m2), power-of-2 scales."""

    forward_dtype: torch.dtype = torch.float8_e4m3fn
    backward_dtype: torch.dtype = torch.float8_e4m3fn
    power_2_scale: bool = True

    @classmethod
    def for_format(cls, fp8: str) -> BlockwiseRecipe:
        """The recipe ``train.fp8=<fp8>`` selects (``e4m3`` or ``hybrid``)."""
        grads = torch.float8_e5m2 if fp8 == "hybrid" else torch.float8_e4m3fn
        return cls(
            backward_dtype=grads,
            power_2_scale=os.environ.get(FP32_SCALES_ENV, "0") != "1",
        )


def cpu_emulation(cfg: PretrainConfig, accel: Accelerator) -> BlockwiseRecipe | None:
    """The emulated recipe when ``train.fp8`` is set on CPU, else None (GPU: megatron-core
    and Transformer Engine run FP8 themselves). Recipes other than blockwise are refused."""
    t = cfg.train
    if not t.fp8 or accel.device_type != "cpu":
        return None
    if t.fp8_recipe != "blockwise":
        raise ConfigError(
            f"train.fp8_recipe={t.fp8_recipe} cannot run on CPU: only blockwise is emulated "
            "there; set train.fp8_recipe=blockwise (or run on a GPU with Transformer Engine)"
        )
    return BlockwiseRecipe.for_format(t.fp8)
