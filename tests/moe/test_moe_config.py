"""The MoE router and dispatcher keys: they reach megatron-core's TransformerConfig, and the
combinations megatron-core 0.16.1 rejects are errors naming Titan's key."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from megatron.core.transformer import TransformerConfig

from tests.core.pretrain_runner import TINY_MOE
from titan_core.accelerator.cpu import CpuAccelerator
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.models.gpt import build_transformer_config


def test_router_keys_reach_transformer_config():
    cfg = load_config(
        PretrainConfig, TINY_MOE,
        ["model.moe_router_score_function=sigmoid", "model.moe_router_enable_expert_bias=true",
         "model.moe_router_bias_update_rate=0.005", "model.moe_expert_capacity_factor=1.5",
         "model.moe_token_drop_policy=position", "model.moe_pad_expert_input_to_capacity=true",
         "model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_overlap=true",
         "model.moe_router_topk=3", "model.moe_aux_loss_coeff=0.002"],
    )  # fmt: skip
    tf = build_transformer_config(cfg, CpuAccelerator())
    assert tf.moe_router_score_function == "sigmoid"
    assert tf.moe_router_enable_expert_bias is True
    assert tf.moe_router_bias_update_rate == 0.005
    assert tf.moe_expert_capacity_factor == 1.5
    assert tf.moe_token_drop_policy == "position"
    assert tf.moe_pad_expert_input_to_capacity is True
    assert tf.moe_shared_expert_intermediate_size == 64
    assert tf.moe_shared_expert_overlap is True
    assert (tf.moe_router_topk, tf.moe_aux_loss_coeff) == (3, 0.002)


def test_defaults_keep_megatron_defaults():
    tf = build_transformer_config(load_config(PretrainConfig, TINY_MOE, []), CpuAccelerator())
    assert tf.moe_router_score_function == "softmax"
    assert tf.moe_router_enable_expert_bias is False
    assert tf.moe_expert_capacity_factor is None
    assert tf.moe_pad_expert_input_to_capacity is False
    assert tf.moe_shared_expert_overlap is False


#: (Titan overrides, the key the error must name, the same combination in megatron's names,
#: megatron's own message for it)
BAD = [
    (["model.moe_router_enable_expert_bias=true"], "model.moe_router_score_function=sigmoid",
     {"moe_router_enable_expert_bias": True}, "only supports sigmoid"),
    (["model.moe_expert_capacity_factor=1.0", "model.moe_router_load_balancing_type=sinkhorn"],
     "model.moe_expert_capacity_factor",
     {"moe_expert_capacity_factor": 1.0, "moe_router_load_balancing_type": "sinkhorn"},
     "moe_expert_capacity_factor only works with"),
    (["model.moe_pad_expert_input_to_capacity=true"], "model.moe_expert_capacity_factor",
     {"moe_pad_expert_input_to_capacity": True}, "must be set to use moe_pad"),
    (["model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_overlap=true",
      "model.moe_token_dispatcher_type=allgather"], "model.moe_token_dispatcher_type=alltoall",
     {"moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": True,
      "moe_token_dispatcher_type": "allgather"}, "only works with alltoall"),
    (["model.moe_token_dispatcher_type=flex", "model.moe_expert_capacity_factor=1.0",
      "model.moe_pad_expert_input_to_capacity=true", "parallel.expert_model_parallel_size=2"],
     "model.moe_pad_expert_input_to_capacity",
     {"moe_token_dispatcher_type": "flex", "moe_expert_capacity_factor": 1.0,
      "moe_pad_expert_input_to_capacity": True, "expert_model_parallel_size": 2},
     "does not support moe_pad_expert_input_to_capacity"),
    (["train.bf16=true", "parallel.overlap_moe_expert_parallel_comm=true"],
     "parallel.expert_model_parallel_size > 1",
     {"bf16": True, "overlap_moe_expert_parallel_comm": True}, "with expert model parallelism"),
    (["train.bf16=true", "parallel.overlap_moe_expert_parallel_comm=true",
      "parallel.expert_model_parallel_size=2", "model.moe_token_dispatcher_type=allgather"],
     "model.moe_token_dispatcher_type",
     {"bf16": True, "overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 2,
      "moe_token_dispatcher_type": "allgather"}, "alltoall/flex token dispatcher"),
    (["train.bf16=true", "parallel.overlap_moe_expert_parallel_comm=true",
      "parallel.expert_model_parallel_size=2", "parallel.pipeline_model_parallel_size=2"],
     "parallel.virtual_pipeline_model_parallel_size",
     {"bf16": True, "overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 2,
      "pipeline_model_parallel_size": 2, "pipeline_dtype": torch.float32},
     "virtual_pipeline_model_parallel_size must be specified"),
    (["train.bf16=true", "parallel.overlap_moe_expert_parallel_comm=true",
      "parallel.expert_model_parallel_size=2", "model.moe_shared_expert_intermediate_size=64",
      "model.moe_shared_expert_overlap=true"], "model.moe_shared_expert_overlap",
     {"bf16": True, "overlap_moe_expert_parallel_comm": True, "expert_model_parallel_size": 2,
      "moe_shared_expert_intermediate_size": 64, "moe_shared_expert_overlap": True},
     "disable moe_shared_expert_overlap"),
]  # fmt: skip


@pytest.mark.parametrize("overrides, needle", [case[:2] for case in BAD])
def test_bad_combination_names_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, TINY_MOE, overrides)
    assert needle in str(e.value)


@pytest.mark.parametrize("megatron_kwargs, message", [case[2:] for case in BAD])
def test_megatron_rejects_the_same_combination(megatron_kwargs, message):
    """Each check above stands for a real megatron-core 0.16.1 refusal, not a guess."""
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=8,
                moe_token_dispatcher_type="alltoall")  # fmt: skip
    with pytest.raises((AssertionError, ValueError), match=message):
        TransformerConfig(**{**base, **megatron_kwargs})


def test_flex_at_ep1_names_the_key():
    with pytest.raises(ConfigError, match="parallel.expert_model_parallel_size x"):
        load_config(PretrainConfig, TINY_MOE, ["model.moe_token_dispatcher_type=flex"])


def test_flex_without_deepep_names_the_key_and_package():
    cfg = load_config(
        PretrainConfig, TINY_MOE,
        ["model.moe_token_dispatcher_type=flex", "parallel.expert_model_parallel_size=2"],
    )  # fmt: skip
    with pytest.raises(ConfigError) as e:
        build_transformer_config(cfg, CpuAccelerator())
    assert "model.moe_token_dispatcher_type=flex" in str(e.value)
    assert "deep_ep" in str(e.value)


@pytest.mark.skipif(
    importlib.util.find_spec("grouped_gemm") is not None, reason="grouped_gemm is installed"
)
def test_grouped_gemm_without_a_kernel_names_the_key():
    cfg = load_config(PretrainConfig, TINY_MOE, ["model.moe_grouped_gemm=true"])
    with pytest.raises(ConfigError, match="model.moe_grouped_gemm.*grouped_gemm package"):
        build_transformer_config(cfg, CpuAccelerator())
