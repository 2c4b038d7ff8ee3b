"""Build megatron-core ``GPTModel`` chunks (one per virtual pipeline stage) from config.

On CPU (and wherever Transformer Engine is absent) the local layer spec is used; with TE
present and ``model.transformer_impl`` auto or transformer_engine, the TE spec, which is
also what FP8 needs on GPU. On CPU, ``train.fp8`` with the blockwise recipe is emulated: the
decoder's linears get :mod:`titan_core.fp8`'s GEMM at build (``install_blockwise_fp8``).
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import get_num_layers_to_build

from titan_core.accelerator import Accelerator, megatron_scope
from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import PretrainConfig
from titan_core.fp8 import cpu_emulation
from titan_core.fp8.install import install_blockwise_fp8
from titan_core.models.sdpa_attention import with_sdpa_attention
from titan_core.models.transformer_impl import use_transformer_engine


def padded_vocab_size(vocab_size: int, cfg: PretrainConfig, saved_rows: int | None = None) -> int:
    """The model's vocabulary rows: Megatron's padding (a multiple of
    ``make_vocab_size_divisible_by`` x TP) for a new model; for one loaded from a checkpoint,
    the checkpoint's own rows (``saved_rows``), so the same weights make the same model at
    any TP. Padding rows are weights too (the output layer scores them): a layout whose TP
    cannot split the saved rows is refused rather than re-padded into another model."""
    tp = cfg.parallel.tensor_model_parallel_size
    if saved_rows is None:
        multiple = cfg.model.make_vocab_size_divisible_by * tp
        return ((vocab_size + multiple - 1) // multiple) * multiple
    if saved_rows < vocab_size:
        raise ConfigError(
            f"the checkpoint's vocabulary has {saved_rows} rows but the tokenizer has "
            f"{vocab_size} tokens: load a checkpoint trained with this tokenizer"
        )
    if saved_rows % tp:
        raise ConfigError(
            f"the checkpoint's vocabulary has {saved_rows} rows (padding included), which "
            f"parallel.tensor_model_parallel_size={tp} cannot split evenly; use a TP size that "
            f"divides {saved_rows}"
        )
    return saved_rows


def _check_moe_kernels(cfg: PretrainConfig, accel: Accelerator, te: bool) -> None:
    """The MoE paths that need a package or a device this host may not have."""
    m = cfg.model
    if m.moe_token_dispatcher_type == "flex" and not accel.supports("deep_ep"):
        why = "is not importable" if accel.device_type != "cpu" else "runs on a GPU only"
        raise ConfigError(
            "model.moe_token_dispatcher_type=flex needs DeepEP (the deep_ep package; MT-DeepEP "
            f"on MUSA), which {why} here (accelerator: {accel.name}); install DeepEP on a GPU "
            "host or set model.moe_token_dispatcher_type=alltoall"
        )
    if m.moe_grouped_gemm and not te and importlib.util.find_spec("grouped_gemm") is None:
        raise ConfigError(
            "model.moe_grouped_gemm needs Transformer Engine (TEGroupedMLP) or the grouped_gemm "
            "package (megatron-core's legacy GroupedMLP), neither available here; unset "
            "model.moe_grouped_gemm"
        )


def build_transformer_config(
    cfg: PretrainConfig, accel: Accelerator, routing_replay: bool = False
) -> TransformerConfig:
    """``routing_replay``: MoE routers get megatron-core's ``RouterReplay`` (RL's
    ``algo.routing_replay``: the trainer replays the rollout engine's routing)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    te = use_transformer_engine(cfg, accel)
    emulated_fp8 = cpu_emulation(cfg, accel)  # CPU: blockwise FP8 in plain torch
    if t.fp8 and not te and not emulated_fp8:
        raise ConfigError(
            f"train.fp8={t.fp8} needs Transformer Engine on a GPU (accelerator: {accel.name}); "
            "unset train.fp8"
        )
    if m.num_moe_experts:
        _check_moe_kernels(cfg, accel, te)
    dtype = torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32
    on_cpu = accel.device_type == "cpu"
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or (4 * m.hidden_size if not m.swiglu else None),
        kv_channels=m.kv_channels,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=torch.nn.functional.silu if m.swiglu else torch.nn.functional.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        init_method_std=m.init_method_std,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
        sequence_parallel=p.sequence_parallel,
        overlap_p2p_comm=p.overlap_p2p_comm and p.virtual_pipeline_model_parallel_size is not None,
        # gloo's batched isend/irecv misorders interleaved-schedule messages (seen on CPU).
        batch_p2p_comm=accel.supports("batched_p2p")
        and not (p.overlap_p2p_comm and p.virtual_pipeline_model_parallel_size),
        overlap_moe_expert_parallel_comm=p.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=p.delay_wgrad_compute,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=t.bf16,
        fp16=t.fp16,
        use_cpu_initialization=accel.supports("requires_cpu_initialization"),
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False if on_cpu else m.swiglu,
        # Apex kernels: megatron's local spec asserts when they are asked for without Apex
        # (first seen on an H200 with neither Apex nor Transformer Engine installed)
        masked_softmax_fusion=accel.supports("fused_kernels"),
        persist_layer_norm=accel.supports("fused_kernels"),
        apply_rope_fusion=False,
        bias_dropout_fusion=not on_cpu,
        cross_entropy_loss_fusion=False,
        deallocate_pipeline_outputs=True,
    )
    if m.num_moe_experts:
        kwargs.update(
            num_moe_experts=m.num_moe_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_router_load_balancing_type=m.moe_router_load_balancing_type,
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_dtype=m.moe_router_dtype,
            moe_grouped_gemm=m.moe_grouped_gemm,
            moe_token_dispatcher_type=m.moe_token_dispatcher_type,
            moe_layer_freq=m.moe_layer_freq,
            moe_shared_expert_overlap=m.moe_shared_expert_overlap,
            moe_router_score_function=m.moe_router_score_function,
            moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
            moe_router_bias_update_rate=m.moe_router_bias_update_rate,
            moe_expert_capacity_factor=m.moe_expert_capacity_factor,
            moe_token_drop_policy=m.moe_token_drop_policy,
            moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
        )
        if m.moe_token_dispatcher_type == "flex":
            kwargs["moe_flex_dispatcher_backend"] = m.moe_flex_dispatcher_backend
        if routing_replay:
            kwargs["moe_enable_routing_replay"] = True
    if t.fp8 and not emulated_fp8:
        kwargs.update(fp8=t.fp8, fp8_recipe=t.fp8_recipe)
    if t.recompute_granularity:
        kwargs.update(
            recompute_granularity=t.recompute_granularity,
            recompute_method=t.recompute_method,
            recompute_num_layers=t.recompute_num_layers,
            recompute_modules=list(t.recompute_modules),
        )
    if t.offload_modules:
        kwargs.update(
            fine_grained_activation_offloading=True,
            offload_modules=list(t.offload_modules),
            min_offloaded_tensor_size=t.offload_min_tensor_size,
        )
    try:
        return TransformerConfig(**kwargs)
    except (AssertionError, ValueError) as e:  # megatron validates in __post_init__
        raise ConfigError(f"megatron-core rejected the model/parallel config: {e}") from None


def _layer_spec(cfg: PretrainConfig, tf: TransformerConfig, te: bool, vp_stage: int | None):
    m = cfg.model
    if m.num_moe_experts and m.moe_layer_freq != 1:
        block = get_gpt_decoder_block_spec(
            tf, use_transformer_engine=te, normalization=m.normalization, vp_stage=vp_stage
        )
        return block if te else with_sdpa_attention(block)
    if te:
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=m.num_moe_experts,
            moe_grouped_gemm=m.moe_grouped_gemm,
            qk_layernorm=m.qk_layernorm,
        )
    # without TE: megatron's unfused core attention replaced by the fused SDPA kernel
    return with_sdpa_attention(
        get_gpt_layer_local_spec(
            num_experts=m.num_moe_experts,
            moe_grouped_gemm=m.moe_grouped_gemm,
            qk_layernorm=m.qk_layernorm,
            normalization=m.normalization,
        )
    )


def layers_per_stage(tf: TransformerConfig) -> list[int]:
    """The decoder layers megatron-core builds on each pipeline stage (its virtual chunks
    together), by the function its decoder block builds them with."""
    vpp = tf.virtual_pipeline_model_parallel_size
    chunks = list(range(vpp)) if vpp else [None]
    return [
        sum(get_num_layers_to_build(tf, vp_stage=v, pp_rank=rank) for v in chunks)
        for rank in range(tf.pipeline_model_parallel_size)
    ]


@megatron_scope()
def build_model_chunks(
    cfg: PretrainConfig, tf: TransformerConfig, vocab_size: int, accel: Accelerator
) -> list[GPTModel]:
    """The model chunks this rank holds (one, or one per virtual pipeline stage)."""
    te = use_transformer_engine(cfg, accel)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    stages = list(range(vpp)) if vpp else [None]
    chunks = []
    for vp_stage in stages:
        model = GPTModel(
            config=tf,
            transformer_layer_spec=_layer_spec(cfg, tf, te, vp_stage),
            vocab_size=vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings or cfg.model.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            post_process=parallel_state.is_pipeline_last_stage(
                ignore_virtual=False, vp_stage=vp_stage
            ),
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.model.position_embedding_type,
            rotary_base=int(cfg.model.rotary_base),
            vp_stage=vp_stage,
        )
        if fp8 := cpu_emulation(cfg, accel):  # the decoder's GEMMs, as TE's FP8 on GPU
            install_blockwise_fp8(model.decoder, fp8)
        model.to(accel.device())
        chunks.append(model)
    return chunks
