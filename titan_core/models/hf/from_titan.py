"""The HF config of a Titan-native GPT (Llama when dense, Qwen3-MoE when MoE), for export to
HF engines.

Titan's default GPT (RMSNorm, SwiGLU, RoPE, no biases) is a Llama; this writes the
config.json an HF-speaking engine (the built-in one, SGLang) needs to load its weights.
"""

from __future__ import annotations

from typing import Any

from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import ModelConfig


def llama_config_for(
    model: ModelConfig, vocab_size: int, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A transformers ``LlamaConfig`` dict with the same shapes and numerics as ``model``."""
    problems = []
    if model.num_moe_experts:
        problems.append("MoE (export a Qwen3-MoE checkpoint loaded from HF instead)")
    if model.normalization != "RMSNorm" or not model.swiglu or model.add_bias_linear:
        problems.append("only RMSNorm + SwiGLU without biases is a Llama")
    if model.position_embedding_type != "rope":
        problems.append("only RoPE position embeddings are a Llama")
    if model.qk_layernorm or model.add_qkv_bias:
        problems.append("qk_layernorm / qkv bias are not Llama (use a Qwen checkpoint)")
    if problems:
        raise ConfigError("cannot export this model as HF Llama: " + "; ".join(problems))
    heads = model.num_attention_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size or 4 * model.hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": model.num_query_groups or heads,
        "head_dim": model.kv_channels or model.hidden_size // heads,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_position_embeddings or model.seq_length,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rotary_base,
        "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
        "vocab_size": vocab_size,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": model.init_method_std,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }


def qwen3_moe_config_for(
    model: ModelConfig, vocab_size: int, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A transformers ``Qwen3MoeConfig`` dict with the same shapes and numerics as the MoE
    ``model`` (every layer MoE, no shared expert, top-k renormalised softmax router)."""
    problems = []
    if not model.qk_layernorm or model.add_qkv_bias:
        problems.append("Qwen3-MoE has qk_layernorm and no qkv bias (set model.qk_layernorm=true)")
    if model.moe_shared_expert_intermediate_size:
        problems.append("shared experts are not Qwen3-MoE")
    if model.moe_layer_freq != 1:
        problems.append("model.moe_layer_freq != 1 (dense layers between MoE) is not mapped")
    if problems:
        raise ConfigError("cannot export this model as HF Qwen3-MoE: " + "; ".join(problems))
    dense = llama_config_for(
        model.model_copy(update={"num_moe_experts": None, "qk_layernorm": False}),
        vocab_size,
        eos_token_id,
    )
    return {
        **dense,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": model.num_moe_experts,
        "num_experts_per_tok": model.moe_router_topk,
        "moe_intermediate_size": model.moe_ffn_hidden_size or dense["intermediate_size"],
        "norm_topk_prob": True,  # megatron's default router renormalises over the top-k
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": model.moe_aux_loss_coeff,
        "output_router_logits": False,
        "use_sliding_window": False,
    }


def qwen3_config_for(
    model: ModelConfig, vocab_size: int, eos_token_id: int | None = None
) -> dict[str, Any]:
    """A transformers ``Qwen3Config`` dict for a dense ``model`` with qk_layernorm (a Llama
    whose query and key heads are RMS-normalised)."""
    if model.add_qkv_bias:
        raise ConfigError("cannot export this model as HF Qwen3: Qwen3 has no qkv bias")
    dense = llama_config_for(model.model_copy(update={"qk_layernorm": False}), vocab_size,
                             eos_token_id)  # fmt: skip
    return {**dense, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "use_sliding_window": False}  # fmt: skip


def hf_config_for(
    model: ModelConfig, vocab_size: int, eos_token_id: int | None = None
) -> dict[str, Any]:
    """The HF config to export ``model`` as: Qwen3-MoE when it has experts, Qwen3 when its
    query / key heads are normalised, else Llama."""
    if model.num_moe_experts:
        return qwen3_moe_config_for(model, vocab_size, eos_token_id)
    if model.qk_layernorm:
        return qwen3_config_for(model, vocab_size, eos_token_id)
    return llama_config_for(model, vocab_size, eos_token_id)
