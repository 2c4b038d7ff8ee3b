"""Route megatron-core's linear layers through the emulated blockwise FP8 GEMM.

:func:`install_blockwise_fp8` is called once per model chunk at build time (never at import):
it replaces the ``_forward_impl`` of every ``ColumnParallelLinear`` / ``RowParallelLinear``
under the module given (the decoder: attention QKV and projection, MLP FC1 and FC2, and the
MoE experts' GEMMs of ``SequentialMLP``) by :func:`blockwise_fp8_forward_impl`. The layers'
parameters, state dict and communication stay megatron-core's; only the GEMM changes. As on
GPU with Transformer Engine, embeddings and the output layer stay in high precision (the
caller passes the decoder alone).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.moe.experts import GroupedMLP, TEGroupedMLP

from titan_core.config.loader import ConfigError
from titan_core.fp8.linear import fp8_linear
from titan_core.fp8.recipe import BlockwiseRecipe


def blockwise_fp8_forward_impl(
    recipe: BlockwiseRecipe,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool = False,
    allreduce_dgrad: bool = False,
    sequence_parallel: bool = False,
    grad_output_buffer: list | None = None,
    wgrad_deferral_limit: int | None = None,
    tp_group: Any = None,
) -> torch.Tensor:
    """megatron-core's ``linear_with_grad_accumulation_and_async_allreduce`` contract with an
    FP8 GEMM: the sequence-parallel all-gather (reduce-scatter of dgrad) and the dgrad
    all-reduce come from megatron-core's own autograd mappings, unfused."""
    if grad_output_buffer is not None:
        raise NotImplementedError("deferred embedding wgrad is not emulated in FP8")
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, True, group=tp_group)
    elif allreduce_dgrad:
        input = copy_to_tensor_model_parallel_region(input, group=tp_group)
    return fp8_linear(input, weight, bias, recipe)


def install_blockwise_fp8(module: torch.nn.Module, recipe: BlockwiseRecipe) -> int:
    """Make every megatron-core parallel linear under ``module`` run its GEMMs in emulated
    blockwise FP8; returns how many layers were switched."""
    count = 0
    for name, layer in module.named_modules():
        if isinstance(layer, (GroupedMLP, TEGroupedMLP)):
            raise ConfigError(
                f"train.fp8 on CPU emulates megatron-core's parallel linear layers, not the "
                f"grouped-GEMM experts ({name}); set model.moe_grouped_gemm=false"
            )
        if isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
            layer._forward_impl = functools.partial(blockwise_fp8_forward_impl, recipe)
            layer.fp8_emulation = recipe
            count += 1
    return count
