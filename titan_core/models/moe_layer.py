"""One megatron-core MoE layer on its own, from a pretraining config (benchmarks, tests).

Needs megatron's process groups (``titan_core.parallel.initialize``), like the whole model.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import build_module

from titan_core.accelerator import Accelerator, megatron_scope
from titan_core.config.pretrain import PretrainConfig
from titan_core.models.gpt import build_transformer_config


@megatron_scope()
def build_moe_layer(cfg: PretrainConfig, accel: Accelerator, layer_number: int = 1) -> MoELayer:
    """The MoE MLP block of ``cfg.model`` (router, dispatcher, this rank's experts)."""
    if not cfg.model.num_moe_experts:
        raise ValueError("build_moe_layer needs an MoE model: set model.num_moe_experts")
    tf = build_transformer_config(cfg, accel)
    spec = get_gpt_layer_local_spec(
        num_experts=cfg.model.num_moe_experts,
        moe_grouped_gemm=cfg.model.moe_grouped_gemm,
        normalization=cfg.model.normalization,
    ).submodules.mlp
    layer = build_module(spec, config=tf)
    layer.set_layer_number(layer_number)
    return layer.to(accel.device())


def skewed_tokens(
    router: TopKRouter, num_tokens: int, skew: float, favoured: int, generator: torch.Generator
) -> torch.Tensor:
    """``[num_tokens, 1, hidden]`` standard-normal tokens shifted by ``skew`` along the sum of
    the router's first ``favoured`` expert rows, so those experts score high for most tokens."""
    weight = router.weight.detach().float()
    direction = weight[:favoured].sum(dim=0)
    direction = direction / direction.norm()
    noise = torch.randn(num_tokens, 1, weight.shape[1], generator=generator)
    return (noise + skew * direction).to(weight.device, router.weight.dtype)


@torch.no_grad()
def update_expert_bias(router: TopKRouter) -> None:
    """What megatron's ``finalize_model_grads`` does to each router after a training step
    (the pretraining loop gets it there): move the bias by the sign of (mean load - load),
    all-reduced over TP x DP x CP, and zero the step's counter."""
    updated = get_updated_expert_bias(
        router.local_tokens_per_expert.clone(),
        router.expert_bias,
        router.config.moe_router_bias_update_rate,
    )
    router.expert_bias.copy_(updated)
    router.local_tokens_per_expert.zero_()
