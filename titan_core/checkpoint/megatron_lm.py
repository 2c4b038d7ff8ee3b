"""The common state Megatron-LM reads from a ``torch_dist`` checkpoint, as Titan writes it.

Megatron-LM's ``save_checkpoint`` (``megatron/training/checkpointing.py``,
``generate_state_dict``) puts, beside the sharded ``model`` and ``optimizer``: ``args`` (its
``argparse.Namespace``), ``checkpoint_version`` (3.0), ``iteration``,
``num_floating_point_operations_so_far``, ``opt_param_scheduler``, ``rng_state`` and
``rerun_state_machine``, and hands ``dist_checkpointing.save`` the ``content_metadata`` the
optimizer state was sharded with. Its ``load_checkpoint`` reads ``iteration``,
``checkpoint_version``, ``opt_param_scheduler``; of ``args`` what ``check_checkpoint_args``
compares with its own (``num_layers``, ``hidden_size``, ``num_attention_heads``, ...), the
saved layout (``tensor_model_parallel_size``, ``pipeline_model_parallel_size``,
``world_size``, ``data_parallel_size``), the data position (``consumed_train_samples``,
...) and ``no_save_optim`` / ``no_save_rng``: a checkpoint saved without them is loaded
without them, as with ``--no-load-optim`` / ``--no-load-rng``. Titan saves no RNG state
(``no_save_rng=True``), nor a rerun state machine (Megatron-LM then ignores it).

Titan's own state stays under the ``common`` key (step, data position, config).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

#: Megatron-LM's ``checkpoint_version`` of ``torch_dist`` checkpoints
CHECKPOINT_VERSION = 3.0

#: the classes (beyond what ``torch.load(weights_only=True)`` reads anyway) a Titan
#: ``common.pt`` holds: Megatron-LM's ``args``
SAFE_GLOBALS: tuple[type, ...] = (argparse.Namespace,)

#: what Megatron-LM's ``_build_sharded_state_dict_metadata`` gives with
#: ``--dist-ckpt-optim-fully-reshardable`` (less its process group), saved as the
#: checkpoint's content metadata: the optimizer state per parameter, loadable at any layout
CONTENT_METADATA: dict[str, Any] = {
    "distrib_optim_sharding_type": "fully_reshardable",
    "distrib_optim_fully_reshardable_mem_efficient": False,
    "singleton_local_shards": False,
    "chained_optim_avoid_prefix": True,
}

#: what Titan's checkpoints were sharded with before they carried content metadata
LEGACY_CONTENT_METADATA: dict[str, Any] = {"distrib_optim_sharding_type": "fully_reshardable"}

_registered = False


def register_safe_globals() -> None:
    """Let ``torch.load(weights_only=True)`` (torch's default; megatron-core's
    ``load_common`` calls it so) read what Titan writes into ``common.pt``: the classes in
    :data:`SAFE_GLOBALS`, through ``torch.serialization.add_safe_globals``. Called once, by
    ``titan_core.checkpoint``'s import: every Titan save or load goes through that package.
    (megatron-core registers its own list at its import: the enums Megatron-LM's ``args``
    carries.)"""
    global _registered
    if not _registered:
        torch.serialization.add_safe_globals(list(SAFE_GLOBALS))
        _registered = True


def read_common(path: str | Path) -> dict[str, Any]:
    """``common.pt`` at ``path`` read with ``weights_only=True`` (no code in the file runs).
    One written by Megatron-LM (slime's converter, a slime run) carries megatron-core's
    enums in its ``args``: megatron-core registers those itself at its import
    (``megatron/core/safe_globals.py``), which happens here if a first read needs it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        if "megatron.core" in sys.modules:
            raise
    import megatron.core  # noqa: F401  (registers megatron-core's safe globals)

    return torch.load(path, map_location="cpu", weights_only=True)


def _activation(tf: Any) -> str:
    return getattr(getattr(tf, "activation_func", None), "__name__", "")


def _model_args(chunk: Any) -> dict[str, Any]:
    """The architecture, under Megatron-LM's argument names, of a megatron-core GPTModel."""
    tf = chunk.config
    heads, groups = tf.num_attention_heads, tf.num_query_groups or tf.num_attention_heads
    pos = getattr(chunk, "position_embedding_type", "rope")
    return {
        "num_layers": tf.num_layers,
        "hidden_size": tf.hidden_size,
        "ffn_hidden_size": tf.ffn_hidden_size,
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": tf.kv_channels,
        "max_position_embeddings": getattr(chunk, "max_sequence_length", None),
        "padded_vocab_size": getattr(chunk, "vocab_size", None),
        "position_embedding_type": pos,
        # Megatron-LM's --no-position-embedding (deprecated): True unless given, rope included
        "add_position_embedding": True,
        "use_rotary_position_embeddings": pos == "rope",
        "rotary_base": getattr(chunk, "rotary_base", None),
        "rotary_percent": getattr(chunk, "rotary_percent", None),
        "rotary_interleaved": tf.rotary_interleaved,
        "untie_embeddings_and_output_weights": not getattr(
            chunk, "share_embeddings_and_output_weights", True
        ),
        "normalization": tf.normalization,
        "norm_epsilon": tf.layernorm_epsilon,
        "apply_layernorm_1p": tf.layernorm_zero_centered_gamma,
        "swiglu": bool(tf.gated_linear_unit) and _activation(tf) == "silu",
        "squared_relu": _activation(tf) == "squared_relu",
        "add_bias_linear": tf.add_bias_linear,
        "add_qkv_bias": tf.add_qkv_bias,
        "qk_layernorm": tf.qk_layernorm,
        "apply_query_key_layer_scaling": tf.apply_query_key_layer_scaling,
        "attention_dropout": tf.attention_dropout,
        "hidden_dropout": tf.hidden_dropout,
        "init_method_std": tf.init_method_std,
        "num_experts": tf.num_moe_experts,
        "moe_ffn_hidden_size": tf.moe_ffn_hidden_size if tf.num_moe_experts else None,
        "moe_router_topk": tf.moe_router_topk,
        "moe_layer_freq": tf.moe_layer_freq,
        "moe_shared_expert_intermediate_size": tf.moe_shared_expert_intermediate_size,
        "moe_router_score_function": tf.moe_router_score_function,
        "moe_router_pre_softmax": tf.moe_router_pre_softmax,
        "moe_router_enable_expert_bias": tf.moe_router_enable_expert_bias,
        "moe_router_topk_scaling_factor": tf.moe_router_topk_scaling_factor,
        "moe_grouped_gemm": tf.moe_grouped_gemm,
        "moe_token_dispatcher_type": tf.moe_token_dispatcher_type,
        "bf16": tf.bf16,
        "fp16": tf.fp16,
        "tensor_model_parallel_size": tf.tensor_model_parallel_size,
        "pipeline_model_parallel_size": tf.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": tf.virtual_pipeline_model_parallel_size,
        "context_parallel_size": tf.context_parallel_size,
        "expert_model_parallel_size": tf.expert_model_parallel_size,
        "expert_tensor_parallel_size": tf.expert_tensor_parallel_size,
        "sequence_parallel": tf.sequence_parallel,
    }


def _layout_args() -> dict[str, Any]:
    """The job's size and data-parallel size (what Megatron-LM compares to keep the rerun
    state machine's state)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    world = dist.get_world_size() if dist.is_initialized() else 1
    dp = ps.get_data_parallel_world_size() if ps.model_parallel_is_initialized() else world
    return {"world_size": world, "data_parallel_size": dp}


def _config_args(config: Mapping[str, Any]) -> dict[str, Any]:
    """What a Titan config (a pretraining run's, saved in its common state) says under
    Megatron-LM's names."""
    model, train, data = (config.get(k) or {} for k in ("model", "train", "data"))
    out = {
        "seq_length": model.get("seq_length"),
        "make_vocab_size_divisible_by": model.get("make_vocab_size_divisible_by"),
        "micro_batch_size": train.get("micro_batch_size"),
        "global_batch_size": train.get("global_batch_size"),
        "seed": train.get("seed"),
        "tokenizer_model": data.get("tokenizer_model"),
    }
    if data.get("tokenizer_type") == "hf":
        out["tokenizer_type"] = "HuggingFaceTokenizer"
    return {k: v for k, v in out.items() if v is not None}


def megatron_args(
    chunk: Any | None, optimizer: Any | None, common: Mapping[str, Any]
) -> argparse.Namespace:
    """Megatron-LM's ``args`` for a checkpoint of ``chunk`` (the first model chunk, unwrapped;
    None: no model) with ``optimizer``'s state (None: without it) and Titan's ``common``
    state. Values are plain Python (no class beyond the Namespace itself)."""
    args: dict[str, Any] = {
        "ckpt_format": "torch_dist",
        "use_dist_ckpt": True,
        "no_save_optim": optimizer is None,
        "no_save_rng": True,
        "use_distributed_optimizer": _distributed(optimizer),
        "dist_ckpt_optim_fully_reshardable": True,
        "ckpt_fully_parallel_save": False,
        "make_vocab_size_divisible_by": 128,
        "tokenizer_type": None,
        "vocab_file": None,
        "data_parallel_random_init": False,
        "consumed_train_samples": int(common.get("consumed_samples") or 0),
        "skipped_train_samples": 0,
        "consumed_valid_samples": 0,
    }
    if chunk is not None:
        args.update(_model_args(chunk))
        args["seq_length"] = args["max_position_embeddings"]
    args.update(_layout_args())
    if isinstance(common.get("config"), Mapping):
        args.update(_config_args(common["config"]))
    return argparse.Namespace(**args)


def _distributed(optimizer: Any | None) -> bool:
    if optimizer is None:
        return False
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in parts)


def common_state(
    iteration: int, chunk: Any | None, optimizer: Any | None, common: Mapping[str, Any]
) -> dict[str, Any]:
    """The top-level common keys Megatron-LM's ``generate_state_dict`` writes (RNG and rerun
    state aside), for Titan's ``common`` state at ``iteration``; Titan's scheduler state
    is Megatron-LM's ``opt_param_scheduler`` (megatron-core's ``OptimizerParamScheduler``
    state dict)."""
    state: dict[str, Any] = {
        "args": megatron_args(chunk, optimizer, common),
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "num_floating_point_operations_so_far": common.get(
            "num_floating_point_operations_so_far", 0
        ),
    }
    if common.get("scheduler") is not None:
        state["opt_param_scheduler"] = common["scheduler"]
    return state
