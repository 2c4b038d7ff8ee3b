"""Every flag of slime's and miles' command lines, in exactly one class.

- :class:`Honoured`: mapped to a Titan config key (``key``, applied when the flag is given
  on the command line, over the Titan YAML), or acted on by the adapter (``acts`` says how).
- :class:`NoEffect`: accepted; a run that gives it prints one start-up line naming it and
  ``reason``.
- :class:`Refused`: a run that gives it exits 2 at parse time naming it and ``instead``.

Flags are keyed by their ``dest`` (argparse's attribute name), shared by slime, miles and
Megatron-LM where they declare the same flag. ``tests/adapters/test_flag_table.py`` walks
every flag of the installed slime and miles parsers (:mod:`adapters.common.peer_flags`) and
Megatron-LM's (:mod:`adapters.common.megatron_flags`) and fails on one missing here; the
table in ``adapters/README.md`` is generated from this one by that test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Honoured:
    #: the Titan key the flag's value goes to (None: the adapter acts on it, see ``acts``)
    key: str | None = None
    acts: str = ""
    #: the flag's value -> the key's value (None: the same value)
    convert: Callable[[Any], Any] | None = None
    #: values the Titan backend cannot run: an error naming the flag, value and why
    refuse_values: tuple[Any, ...] = ()
    refuse_why: str = ""

    def describe(self) -> str:
        return f"`{self.key}`" if self.key and not self.acts else self.acts

    def refuses(self, value: Any) -> bool:
        """Whether ``value`` is one the Titan backend cannot run (``refuse_values``: values,
        or predicates over the value)."""
        return any(r(value) if callable(r) else r == value for r in self.refuse_values)


@dataclass(frozen=True)
class NoEffect:
    reason: str

    def describe(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Refused:
    instead: str

    def describe(self) -> str:
        return self.instead


Entry = Honoured | NoEffect | Refused


def _key(key: str, **kw: Any) -> Honoured:
    return Honoured(key=key, **kw)


def _acts(text: str, **kw: Any) -> Honoured:
    return Honoured(acts=text, **kw)


def _same(section: str, names: str) -> dict[str, Entry]:
    """Flags whose Titan key has the same name in ``section``."""
    return {n: _key(f"{section}.{n}") for n in names.split()}


def _trains_estimator(name: str) -> bool:
    """Whether the Titan backend trains advantage estimator ``name``: one of Titan's whose
    advantage comes from the group's rewards alone (titan_rl.algo.estimators'
    ``from_group_rewards``), as the rollout side's normalised reward is every response
    token's advantage here."""
    from titan_rl.algo.estimators import ESTIMATORS  # torch: only when the flag is given

    return name in ESTIMATORS and ESTIMATORS[name].from_group_rewards


def _group(entry: Entry, names: str) -> dict[str, Entry]:
    return dict.fromkeys(names.split(), entry)


def _moe_layer_freq(value: Any) -> int:
    """Megatron's ``--moe-layer-freq`` (an int N: every N-th layer is MoE, or a per-layer
    0/1 list) as Titan's ``model.moe_layer_freq`` (an int)."""
    if isinstance(value, int):
        return value
    pattern = list(value)
    for freq in range(1, len(pattern) + 1):
        if pattern == [1 if i % freq == 0 else 0 for i in range(len(pattern))]:
            return freq
    raise ValueError(
        f"{value!r}: Titan's MoE models place an MoE layer every N-th layer "
        "(model.moe_layer_freq); this per-layer pattern is not one of those"
    )


_KERNEL = (
    "chooses a fused kernel, not the numbers: Titan leaves kernel fusion to megatron-core's "
    "layer spec (local on CPU, Transformer Engine on GPU)"
)
_TRACK = (
    "as in slime / miles: each rollout's record (metrics.jsonl's keys) goes through their own "
    "tracking code (adapters/common/tracking.py)"
)
_MILES_FT = (
    "miles' fault-tolerant cells are not run by the Titan backend: a run resumes from --save "
    "after a failure; drop the flag"
)
_LORA = "LoRA training is not supported by the Titan backend; train the full model"
_OPD = "on-policy distillation is not supported by the Titan backend; drop the flag"
_CRITIC = "a critic (PPO) is not supported by the Titan backend; use --advantage-estimator grpo"
_DEBUG = "this debug mode is not supported by the Titan backend; drop the flag"
_DSA = "DeepSeek sparse attention is not supported by Titan's models; drop the flag"


FLAG_TABLE: dict[str, Entry] = {
    # ---- Megatron-LM: model shape (Titan's model.* keys use Megatron's names) ---------------
    **_same(
        "model",
        "num_layers hidden_size ffn_hidden_size num_attention_heads kv_channels seq_length "
        "max_position_embeddings swiglu normalization norm_epsilon vocab_size "
        "make_vocab_size_divisible_by qk_layernorm add_bias_linear add_qkv_bias "
        "untie_embeddings_and_output_weights init_method_std hidden_dropout attention_dropout "
        "moe_ffn_hidden_size moe_router_topk moe_router_score_function moe_token_dispatcher_type "
        "moe_grouped_gemm moe_token_drop_policy moe_router_dtype moe_aux_loss_coeff "
        "moe_router_load_balancing_type moe_shared_expert_intermediate_size "
        "moe_shared_expert_overlap moe_router_enable_expert_bias moe_router_bias_update_rate "
        "moe_expert_capacity_factor moe_pad_expert_input_to_capacity moe_flex_dispatcher_backend "
        "transformer_impl",
    ),
    "rotary_base": _key("model.rotary_base", convert=float),
    "num_experts": _key("model.num_moe_experts"),
    "moe_layer_freq": _key("model.moe_layer_freq", convert=_moe_layer_freq),
    "num_query_groups": _acts("`model.num_query_groups` (with --group-query-attention)"),
    "group_query_attention": _acts(
        "grouped-query attention: --num-query-groups goes to `model.num_query_groups`"
    ),
    "use_rotary_position_embeddings": _key(
        "model.position_embedding_type", convert=lambda v: "rope" if v else None
    ),
    "position_embedding_type": _key(
        "model.position_embedding_type",
        refuse_values=("mrope", "relative"),
        refuse_why="Titan's models have rope, learned_absolute or none",
    ),
    "rotary_percent": _acts(
        "checked: Titan's rope rotates the whole head (1.0)",
        refuse_values=(lambda v: float(v) != 1.0,),
        refuse_why="Titan's rope rotates the whole head; partial rotary is not supported",
    ),
    "moe_permute_fusion": NoEffect(_KERNEL),
    "moe_router_padding_for_quantization": NoEffect(
        "pads the routing map for FP8 / FP4 grouped GEMMs; Titan's blockwise FP8 pads its own tiles"
    ),
    # ---- Megatron-LM: parallelism -------------------------------------------------------------
    **_same(
        "parallel",
        "tensor_model_parallel_size pipeline_model_parallel_size "
        "virtual_pipeline_model_parallel_size context_parallel_size expert_model_parallel_size "
        "expert_tensor_parallel_size sequence_parallel use_distributed_optimizer "
        "overlap_grad_reduce overlap_param_gather distributed_timeout_minutes",
    ),
    "num_layers_per_virtual_pipeline_stage": Refused(
        "use --virtual-pipeline-model-parallel-size (chunks per pipeline stage)"
    ),
    "decoder_first_pipeline_num_layers": _key("parallel.num_layers_in_first_pipeline_stage"),
    "decoder_last_pipeline_num_layers": _key("parallel.num_layers_in_last_pipeline_stage"),
    "cp_comm_type": NoEffect(
        "Titan's context parallelism uses megatron-core's default exchange (p2p ring)"
    ),
    "distributed_backend": NoEffect(
        "the process-group backend is the accelerator's: gloo on CPU, nccl on CUDA, mccl on "
        "MUSA (titan_core.accelerator)"
    ),
    # ---- Megatron-LM: recompute, optimizer, schedule, precision ---------------------------
    **_same(
        "train",
        "recompute_granularity recompute_method recompute_num_layers "
        "recompute_modules lr min_lr lr_decay_style lr_warmup_iters lr_decay_iters "
        "weight_decay adam_beta1 adam_beta2 adam_eps clip_grad bf16 fp16 "
        "micro_batch_size",
    ),  # fmt: skip
    # the trainer's random state: Titan's one seed (the prompts' order is --rollout-seed's)
    "seed": _key("run.seed"),
    "fp8_format": _key("train.fp8"),
    "fp8_recipe": _key("train.fp8_recipe"),
    "optimizer": _acts(
        "adam (Titan's optimizer is megatron-core's Adam)",
        refuse_values=("sgd",),
        refuse_why="Titan trains with Adam",
    ),
    "lr_warmup_fraction": Refused("use --lr-warmup-iters"),
    "optimizer_cpu_offload": NoEffect(
        "Titan keeps the Adam state with the parameters; under --colocate / --offload-train "
        "the trainer's sleep moves parameters, gradients and Adam state off the device"
    ),
    "overlap_cpu_optimizer_d2h_h2d": NoEffect(
        "goes with --optimizer-cpu-offload, which Titan does not run (see its line)"
    ),
    "use_precision_aware_optimizer": NoEffect(
        "Titan's Adam keeps fp32 master weights and fp32 moments (the precision-aware "
        "optimizer's default dtypes)"
    ),
    "accumulate_allreduce_grads_in_fp32": NoEffect(
        "Titan always accumulates and all-reduces gradients in fp32 under bf16 / fp16 "
        "(titan_core/training/build.py)"
    ),
    "attention_softmax_in_fp32": NoEffect(
        "Titan's attention computes the softmax in fp32 (megatron-core's default for its "
        "local and TE attention)"
    ),
    "attention_backend": NoEffect(
        "Titan's local layer spec (CPU) runs unfused attention; on GPU Transformer Engine "
        "picks its backend itself"
    ),
    "fp8_param_gather": Refused("FP8 parameter all-gather is not supported; drop the flag"),
    "fp4_format": Refused("FP4 training is not supported; use --fp8-format e4m3"),
    "fp4_recipe": Refused("FP4 training is not supported; use --fp8-recipe blockwise"),
    "te_precision_config_file": Refused("use --fp8-format / --fp8-recipe"),
    "reuse_grad_buf_for_mxfp8_param_ag": Refused("MXFP8 is not supported; drop the flag"),
    "use_cpu_initialization": NoEffect(
        "the weights come from --load / --ref-load / --hf-checkpoint; where they are first "
        "initialised does not change the run"
    ),
    **_group(
        NoEffect(_KERNEL),
        "gradient_accumulation_fusion masked_softmax_fusion bias_swiglu_fusion "
        "apply_rope_fusion cross_entropy_loss_fusion",
    ),
    "ckpt_format": _acts(
        "torch_dist (the only format Titan writes)",
        refuse_values=("torch",),
        refuse_why="Titan reads and writes megatron-core torch_dist checkpoints",
    ),
    "no_load_optim": Refused(
        "a resume restores the Adam state too; start a fresh run from "
        "the checkpoint with --ref-load instead"
    ),  # fmt: skip
    "no_load_rng": NoEffect("Titan's trainer draws no random numbers in an RL step"),
    "finetune": Refused("start from --ref-load (a fresh run) instead"),
    "log_interval": NoEffect("one status line and one metrics.jsonl record per rollout"),
    "tensorboard_dir": NoEffect(
        "Megatron-LM's own TensorBoard writer, which the RL loop does not use; --use-tensorboard "
        "writes to $TENSORBOARD_DIR, else tensorboard_log/<tb-project-name>/<tb-experiment-name>"
    ),
    # ---- slime / miles: cluster ------------------------------------------------------------
    "actor_num_nodes": _acts("trainer ranks = nodes x GPUs per node (slime's placement groups)"),
    "actor_num_gpus_per_node": _acts("trainer ranks per node (one Ray actor each)"),
    "rollout_num_gpus": _acts("engines = rollout GPUs / GPUs per engine"),
    "rollout_num_gpus_per_engine": _key("engines.tp_size"),
    "num_gpus_per_node": _acts("bundles per node in slime's / miles' placement groups"),
    "colocate": _acts(
        "engines share the trainer's bundles; the trainer sleeps (frees its device memory) "
        "while the engines generate, and the engines release theirs while it trains"
    ),
    "offload": _acts("= --offload-train and --offload-rollout"),
    "offload_train": _acts("the trainer sleeps between its steps (frees its device memory)"),
    "offload_rollout": _acts("the engines release their memory while the trainer trains"),
    **_group(
        Refused("miles' train offload targets are not supported; use --offload-train"),
        "offload_rollout_level offload_train_target stream_optimizer_state_to_disk "
        "stream_optimizer_state_moment_dtype offload_train_disk_dir offload_train_disk_chunk_mb",
    ),
    **_group(
        Refused(_CRITIC),
        "critic_num_nodes critic_num_gpus_per_node critic_load critic_save "
        "critic_lr critic_lr_warmup_iters num_critic_only_steps value_clip",
    ),  # fmt: skip
    "sglang_pp_size": _acts(
        "checked: the engines run without pipeline stages",
        refuse_values=(lambda v: int(v) != 1,),
        refuse_why="engines have no pipeline stages",
    ),
    "sglang_pipeline_parallel_size": _acts(
        "checked: the engines run without pipeline stages",
        refuse_values=(lambda v: int(v) != 1,),
        refuse_why="engines have no pipeline stages",
    ),  # fmt: skip
    # ---- slime / miles: modes ----------------------------------------------------------------
    "train_backend": _acts(
        "megatron: Titan's Megatron base trains",
        refuse_values=("fsdp",),
        refuse_why="the Titan backend is Megatron (megatron-core); drop --train-backend fsdp",
    ),
    **_group(
        Refused(_DEBUG),
        "load_debug_rollout_data debug_rollout_only debug_train_only "
        "load_debug_rollout_data_subsample save_debug_train_data save_debug_trajectory_data "
        "save_debug_event_data debug_exit_after_rollout debug_skip_weight_update "
        "debug_disable_optimizer load_forge_rollout_data debug_deterministic_collective",
    ),  # fmt: skip
    # ---- slime / miles: training -----------------------------------------------------------
    "train_env_vars": _acts("set in each trainer rank's environment (slime's RayTrainGroup)"),
    "qwen_gdn_backend": NoEffect("Titan's models have no gated-delta-net layers"),
    "linear_attention_backend": NoEffect("Titan's models have no linear-attention layers"),
    **_group(
        Refused(_DSA),
        "miles_dsa_topk_backend dsa_attention_backend freeze_indexer "
        "use_indexer_replay use_rollout_indexer_replay",
    ),  # fmt: skip
    "qkv_format": NoEffect(
        "Titan pads each micro-batch to its longest row (bshd); the "
        "per-token results are the same as packed thd"
    ),  # fmt: skip
    **_group(
        Refused("miles' true on-policy mode is not supported; drop the flag"),
        "true_on_policy_mode recompute_logprobs_via_prefill",
    ),  # fmt: skip
    "train_memory_margin_bytes": _acts(
        "torch_memory_saver's memory_margin_bytes under --offload-train where torch_memory_saver "
        "offloads the trainer (CUDA, its LD_PRELOAD hook loaded), as miles sets it; elsewhere "
        "the trainer's sleep copies its tensors to host memory and no allocator margin exists"
    ),
    "ft_components": _acts(
        "rollout (miles' default): see --use-fault-tolerance",
        refuse_values=(lambda v: "train" in (v or ()),),
        refuse_why="miles' fault-tolerant trainer cells are not run by the Titan backend (a run "
        "resumes from --save after a failure); use --ft-components rollout",
    ),
    **_group(
        Refused("miles' parameter rematerialisation is not supported; drop the flag"),
        "rematerialize_param_from_master_weight check_rematerialize_param_from_master_weight",
    ),  # fmt: skip
    "megatron_to_hf_mode": _acts(
        "raw: Titan's own HF mapping (titan_core.models.hf)",
        refuse_values=("bridge",),
        refuse_why="Titan maps HF weights itself; drop --megatron-to-hf-mode bridge",
    ),
    **_group(
        Refused("per-layer precision overrides are not supported; drop the flag"),
        "extra_high_precision_layers_hf extra_high_precision_layers_megatron",
    ),
    "custom_model_provider_path": Refused(
        "Titan builds its GPT / MoE model from model.* (a custom provider is not loaded)"
    ),
    "recompute_loss_function": NoEffect(
        "Titan's loss keeps no logits beyond the micro-batch being computed"
    ),
    "log_probs_chunk_size": NoEffect("Titan computes log-probs per micro-batch"),
    **_group(
        Refused(_MILES_FT),
        "indep_dp delay_split_train_data_by_dp use_fault_tolerance "
        "control_server_port mini_ft_controller_enable "
        "mini_ft_controller_poll_interval mini_ft_controller_resume_delay "
        "low_memory_resume enable_witness witness_buffer_size ci_ft_test_actions",
    ),  # fmt: skip
    "mfu_peak_tflops": NoEffect("Titan reports time per phase, not MFU"),
    "allgather_cp": NoEffect("Titan's context parallelism splits sequences itself"),
    "update_weight_disk_dir": _acts("where --update-weight-transport disk writes weight_vNNNNNN"),
    "update_weight_transport": _acts("nccl: Titan's sync.transport; disk: HF files + reload"),
    "update_weight_mode": _acts(
        "full",
        refuse_values=("delta",),
        refuse_why="delta weight updates are not supported; use --update-weight-mode full",
    ),
    **_group(
        Refused("weight-update deltas are not supported; drop the flag"),
        "update_weight_delta_encoding update_weight_delta_checksum",
    ),
    "update_weight_local_checkpoint_dir": Refused("use --update-weight-disk-dir"),
    "update_weight_disk_keep_files": _acts("keep each weight_vNNNNNN folder after the reload"),
    "custom_update_weight_post_write_path": Refused(
        "weight-update hooks are not run by the Titan backend; drop the flag"
    ),
    "update_weight_buffer_size": _key("sync.bucket_bytes"),
    "update_weights_interval": Refused(
        "Titan updates the engines after every rollout; drop the flag"
    ),
    "update_weight_transfer_mode": _acts(
        "broadcast / p2p / disk-delta -> sync.transport distributed / mooncake / disk"
    ),
    **_group(
        NoEffect("Mooncake's P2P transfer is set by sync.* in the Titan YAML"),
        "p2p_transfer_num_workers p2p_transfer_timeout",
    ),
    "release_train": Refused("use --offload-train"),
    **_group(
        Refused("partial-model training is not supported; train the full model"),
        "only_train_params_name_list freeze_params_name_list",
    ),
    "keep_old_actor": Refused(
        "Titan takes the old policy's log-probs before the rollout's first update (no second "
        "model); drop the flag"
    ),
    "ref_update_interval": Refused("the reference model stays fixed in Titan; drop the flag"),
    # ---- slime / miles: rollout ---------------------------------------------------------------
    "hf_checkpoint": _acts(
        "the engines serve it and its tokenizer reads the prompts; its config.json must agree "
        "with the model flags; the policy starts from it when there is no --load / --ref-load; "
        "a weight file that cannot be read (cut short) stops the start naming it"
    ),
    "model_name": NoEffect(
        "a label for slime's / miles' HF export name mapping; Titan maps "
        "by the HF config's architecture"
    ),  # fmt: skip
    "rollout_function_path": _acts(
        "loaded with slime's / miles' load_function (default: the adapter's, over Titan's engines)"
    ),  # fmt: skip
    "eval_function_path": _acts("loaded with load_function (default: the rollout function)"),
    "custom_generate_function_path": _acts("loaded with load_function, per sample"),
    "data_source_path": _acts(
        "loaded with load_function (default: slime's / miles' own source over --prompt-data; "
        "without --prompt-data, the Titan YAML's data section)"
    ),
    "rollout_temperature": _acts("the engines' sampling temperature"),
    "rollout_top_p": _acts("the engines' top_p"),
    "rollout_top_k": _acts("the engines' top_k"),
    "rollout_max_response_len": _acts("max_new_tokens of each response"),
    "rollout_max_prompt_len": _acts("prompts longer than this are dropped (slime's Dataset)"),
    "rollout_max_context_len": _acts("max_new_tokens is cut so prompt + response fit"),
    "rollout_skip_special_tokens": _acts("the engines' skip_special_tokens"),
    "rollout_stop": _acts("the engines' stop texts"),
    "rollout_stop_token_ids": _acts("the engines' stop token ids"),
    "rollout_shuffle": _acts("slime's Dataset shuffles each epoch (seed --rollout-seed + epoch)"),
    "rollout_seed": _acts("slime's Dataset shuffle seed; Titan's prompt sampler seed"),
    "rollout_global_dataset": _acts("the data source reads --prompt-data (slime's default)"),
    "num_rollout": _acts(
        "rollouts to run; `run.num_steps`, so the LR schedule's horizon is slime's "
        "(--num-rollout rollouts)"
    ),
    "num_epoch": _acts("--num-rollout = epochs x prompts / --rollout-batch-size"),
    "prompt_data": _acts("jsonl / parquet prompts through slime's / miles' own Dataset"),
    "input_key": _acts("the prompt column of --prompt-data"),
    "label_key": _acts("the label column of --prompt-data"),
    "metadata_key": _acts("the metadata column of --prompt-data"),
    "tool_key": _acts("the tools column of --prompt-data (given to the chat template)"),
    "multimodal_keys": Refused("Titan's models are text-only; drop the flag"),
    "apply_chat_template": _acts("prompts go through the --hf-checkpoint tokenizer's template"),
    "apply_chat_template_kwargs": _acts("passed to apply_chat_template"),
    "chat_template_path": Refused("put the template in the --hf-checkpoint tokenizer"),
    "start_rollout_id": _acts("the first rollout id (default: after the last --save checkpoint)"),
    "rollout_batch_size": _key("rollout.prompts_per_step"),
    "n_samples_per_prompt": _key("rollout.n_samples_per_prompt"),
    "global_batch_size": _acts("samples per optimizer step (slime's DP schedule)"),
    "num_steps_per_rollout": _acts("= samples per rollout / --global-batch-size"),
    "balance_data": _acts("slime's DP schedule balances tokens over DP ranks"),
    "balance_by_flops": _acts("slime's DP schedule balances by FLOPs"),
    "use_dynamic_batch_size": NoEffect(
        "Titan's trainer cuts micro-batches by length itself (sorted, each cut to its own "
        "longest row: titan_rl/trainer/microbatch.py); the step's result does not depend on it"
    ),
    "max_tokens_per_gpu": NoEffect(
        "goes with --use-dynamic-batch-size (see its line); --micro-batch-size bounds rows"
    ),
    "log_probs_max_tokens_per_gpu": NoEffect("see --max-tokens-per-gpu"),
    "allow_partial_train_step": Refused("Titan trains whole steps; drop the flag"),
    "over_sampling_batch_size": Refused("use rollout.over_sample_factor in the Titan YAML"),
    "dynamic_sampling_filter_path": Refused("use rollout.dynamic_filter in the Titan YAML"),
    "partial_rollout": Refused("use rollout.partial in the Titan YAML (titan_rl.grpo)"),
    "mask_offpolicy_in_partial_rollout": Refused("use rollout.partial in the Titan YAML"),
    "fully_async": Refused("use rollout.async in the Titan YAML (titan_rl.grpo)"),
    **_group(
        Refused("miles' async rollout buffer is not supported; use titan_rl.grpo's rollout.async"),
        "max_weight_staleness async_max_concurrent_samples "
        "async_data_buffer_capacity_factor async_unused_samples_handler "
        "custom_async_data_buffer_path rollout_submission_granularity",
    ),  # fmt: skip
    **_group(
        NoEffect("rollout data moves through Ray's object store"),
        "object_store_backend mooncake_store_init_kwargs mooncake_replica_num "
        "rollout_data_transport",
    ),  # fmt: skip
    "pause_generation_mode": NoEffect("Titan's sync pauses the engines with abort"),
    "pin_rollout_manager_to_head": NoEffect("the rollout manager runs in the driver's Ray node"),
    "rollout_external": _acts("train against engines already running"),
    "rollout_external_engine_addrs": _acts("their host:port addresses"),
    "custom_rollout_log_function_path": Refused("rollout metrics go to metrics.jsonl; drop it"),
    "custom_eval_rollout_log_function_path": Refused("eval metrics go to metrics.jsonl; drop it"),
    "buffer_filter_path": Refused("the Titan backend keeps no rollout buffer; drop the flag"),
    "rollout_data_postprocess_path": Refused("use --custom-convert-samples-to-train-data-path"),
    "rollout_sample_hook_path": Refused("use --custom-generate-function-path"),
    **_group(
        Refused("rollout health checks are Titan's engine supervision (engines.*)"),
        "rollout_health_check_interval rollout_health_check_timeout "
        "rollout_health_check_first_wait",
    ),  # fmt: skip
    # ---- evaluation ---------------------------------------------------------------------
    "eval_interval": _acts("evaluate every N rollouts (and before the first)"),
    "eval_prompt_data": _acts("NAME PATH pairs: each set's mean reward is eval/NAME"),
    "eval_config": Refused("use --eval-prompt-data NAME PATH ..."),
    "skip_eval_before_train": _acts("no evaluation before the first rollout"),
    "eval_input_key": _acts("the prompt column of the eval sets"),
    "eval_label_key": _acts("the label column of the eval sets"),
    "eval_tool_key": _acts("the tools column of the eval sets"),
    "n_samples_per_eval_prompt": _acts("responses per eval prompt"),
    "eval_temperature": _acts("sampling temperature of evaluations"),
    "eval_top_p": _acts("top_p of evaluations"),
    "eval_top_k": _acts("top_k of evaluations"),
    "eval_max_response_len": _acts("max_new_tokens of evaluations"),
    "eval_max_prompt_len": _acts("eval prompts longer than this are dropped"),
    "eval_min_new_tokens": _acts("min_new_tokens of evaluations"),
    "eval_max_context_len": _acts("eval max_new_tokens is cut so prompt + response fit"),
    **_group(
        Refused("evaluations run on the rollout engines; drop the flag"),
        "eval_num_gpus eval_num_gpus_per_engine eval_hf_dir eval_max_in_flight "
        "eval_overflow_policy eval_keep_snapshots",
    ),  # fmt: skip
    # ---- checkpoints ---------------------------------------------------------------------
    "ref_load": _acts(
        "the reference model's weights (a torch_dist checkpoint, e.g. from "
        "python -m adapters.slime.convert_hf_to_torch_dist); the policy starts from it when "
        "--load holds no checkpoint"
    ),
    "ref_ckpt_step": Refused(
        "Titan reads the iteration --ref-load's tracker names; point --ref-load at a folder "
        "whose latest_checkpointed_iteration.txt names the one you want"
    ),
    "load": _acts("resume from the newest checkpoint here (none: start from --ref-load)"),
    "save": _acts(
        "checkpoints (megatron-core torch_dist, Megatron-LM's layout) and the "
        "data source's position"
    ),  # fmt: skip
    "save_interval": _acts("save every N rollouts (and after the last)"),
    "async_save": NoEffect("Titan saves synchronously (the tracker is written last)"),
    "no_save_optim": Refused(
        "Titan's checkpoints hold the Adam state (a resume needs it); drop the flag"
    ),  # fmt: skip
    "save_hf": _acts(
        "after each --save checkpoint, an HF snapshot at save_hf.format(rollout_id=...), as "
        "slime's and miles' Megatron actors write one: config.json, model.safetensors, the "
        "tokenizer (and --hf-checkpoint's other files that are not weights)"
    ),
    "save_trigger_sentinel": Refused("Titan saves on SIGTERM / SIGUSR1; drop the flag"),
    "custom_megatron_post_save_hook_path": Refused("save hooks are not run; drop the flag"),
    "save_retain_interval": _acts(
        "as Megatron-LM: at each save the checkpoint saved before it is deleted unless its "
        "iteration (rollout id) is a multiple of N; the newest and the multiples stay",
        refuse_values=(lambda v: v is not None and v <= 0,),
        refuse_why="a positive interval is needed (Megatron-LM divides by it)",
    ),
    # ---- algorithm ---------------------------------------------------------------------
    "advantage_estimator": _key(
        "algo.advantage_estimator",
        refuse_values=(lambda v: not _trains_estimator(v),),
        refuse_why="the Titan backend trains grpo or gspo (the rollout side's normalised "
        "reward is every response token's advantage)",
    ),
    **_same(
        "algo",
        "eps_clip eps_clip_high eps_clip_c use_kl_loss kl_loss_coef kl_loss_type "
        "entropy_coef use_tis",
    ),  # fmt: skip
    "calculate_per_token_loss": NoEffect(
        "Titan's loss is a per-token mean over the step's trained tokens already"
    ),
    "kl_coef": _acts(
        "checked: 0 (no KL in the reward)",
        refuse_values=(lambda v: float(v or 0) != 0.0,),
        refuse_why="KL in the reward is not supported; use --use-kl-loss --kl-loss-coef",
    ),
    "loss_type": _acts(
        "policy_loss (Titan's PPO-clip policy loss)",
        refuse_values=("sft_loss", "custom_loss"),
        refuse_why="the Titan backend trains the policy loss",
    ),
    "custom_loss_function_path": Refused("custom losses are not loaded; drop the flag"),
    "compute_advantages_and_returns": NoEffect("advantages are the rollout side's rewards"),
    "use_unbiased_kl": Refused("Titan's KL estimators are k1 / k2 / k3 / low_var_kl"),
    **_group(
        NoEffect("discounting applies to a critic's returns, which grpo / gspo do not compute"),
        "gamma lambd",
    ),  # fmt: skip
    "normalize_advantages": Refused(
        "grpo normalises rewards per group (see --disable-grpo-std-normalization); drop the flag"
    ),  # fmt: skip
    "grpo_std_normalization": _acts("rewards divided by their group's std (slime's rule)"),
    "rewards_normalization": _acts("rewards minus their group's mean (slime's rule)"),
    "use_rollout_entropy": Refused("Titan computes entropy from the trainer; drop the flag"),
    "observe_training_entropy": NoEffect("train/entropy is always in metrics.jsonl"),
    "get_mismatch_metrics": NoEffect("mismatch/* metrics are always written"),
    "reset_optimizer_states": Refused("Titan keeps Adam state across rollouts; drop the flag"),
    "use_rollout_logprobs": Refused(
        "Titan's PPO ratio uses the trainer's old log-probs; the engines' are used by --use-tis"
    ),
    "skip_actor_forward_only": Refused("Titan computes old log-probs itself; drop the flag"),
    "tis_clip": _key("algo.tis_clip"),
    "tis_clip_low": _key("algo.tis_clip_low"),
    "custom_tis_function_path": Refused("use --use-tis with --tis-clip / --tis-clip-low"),
    "custom_pg_loss_reducer_function_path": Refused("custom loss reducers are not loaded"),
    "use_routing_replay": _key("algo.routing_replay"),
    "use_rollout_routing_replay": Honoured(
        key="rollout.return_routed_experts",  # the engines' launch (SGLang's flag) reads it
        acts="the engines return routed experts; the trainer replays them (algo.routing_replay)",
    ),  # fmt: skip
    **_group(Refused("OPSM is not supported; drop the flag"), "use_opsm opsm_delta"),
    "megatron_config_path": Refused("per-role Megatron configs: use the Titan YAML"),
    "custom_advantage_function_path": Refused(
        "custom advantages are not loaded; use --custom-reward-post-process-path"
    ),  # fmt: skip
    "use_stateless_adam": Refused("Titan's Adam keeps its moments; drop the flag"),
    **_group(
        Refused(_OPD),
        "use_opd opd_type opd_kl_coef opd_log_prob_top_k "
        "opd_top_k_strategy opd_reward_weight_mode opd_topk_per_position opd_teacher_urls "
        "opd_teacher_key opd_teacher_load opd_teacher_ckpt_step",
    ),  # fmt: skip
    **_group(
        Refused(_LORA),
        "lora_rank lora_alpha lora_dropout lora_type target_modules "
        "exclude_modules lora_adapter_path lora_sync_from_tensor lora_base_cpu_backup "
        "lora_train_only experts_shared_outer_loras multi_lora_n_adapters "
        "multi_lora_adapters multi_lora_idle_poll_s multi_lora_http_server_path "
        "multi_lora_backend_path multi_lora_api_port multi_lora_service_mode "
        "multi_lora_max_adapter_global_batch_size multi_lora_max_coalesce_wait_s "
        "multi_lora_max_empty_wait_s sglang_lora_use_virtual_experts "
        "check_lora_weight_equal",
    ),  # fmt: skip
    # ---- router, tracking, debugging ---------------------------------------------------------
    **_group(
        Refused("miles' router is not run; Titan's engines are reached directly"),
        "use_miles_router miles_router_timeout miles_router_max_connections "
        "miles_router_health_check_failure_threshold",
    ),  # fmt: skip
    **_group(
        NoEffect("SGLang router address / timeout: Titan's engines are reached directly"),
        "sglang_router_ip sglang_router_port sglang_router_policy "
        "sglang_router_request_timeout_secs",
    ),  # fmt: skip
    **_group(
        _acts(_TRACK),
        "use_wandb wandb_mode wandb_dir wandb_key wandb_host wandb_team wandb_project "
        "wandb_random_suffix use_mlflow mlflow_tracking_uri mlflow_experiment_name "
        "mlflow_run_name use_tensorboard tb_project_name tb_experiment_name use_prometheus "
        "prometheus_port prometheus_run_name",
    ),  # fmt: skip
    "wandb_group": _acts(_TRACK + "; default: the run folder's name"),
    "wandb_always_use_train_step": _acts(
        "rollout/step and eval/step are slime's train step (rollout id x samples per rollout "
        "/ --global-batch-size), as in slime"
    ),
    **_group(
        NoEffect(
            "set by the driver's tracker (slime's / miles' primary) for processes that join its "
            "run; none does here, and a given value is replaced, as in slime / miles"
        ),
        "wandb_run_id mlflow_run_id",
    ),
    **_group(
        Refused(
            "miles' dashboard is fed by hooks in miles' rollout manager, router and Megatron "
            "train actors and by SGLang servers' /metrics, which the Titan backend replaces; "
            "use --use-prometheus, --use-wandb or --use-tensorboard"
        ),
        "use_miles_dashboard dashboard_flush_interval dashboard_gpu_sample_interval "
        "dashboard_sglang_scrape_interval dashboard_sglang_scrape_mode dashboard_sglang_metrics "
        "dashboard_forward_prometheus",
    ),  # fmt: skip
    **_group(
        NoEffect("extra wandb panels; Titan's metrics are in metrics.jsonl"),
        "log_multi_turn log_passrate log_reward_category log_correct_samples",
    ),
    "save_debug_rollout_data": _acts(
        "each rollout's and evaluation's samples written by slime's / miles' own "
        "save_debug_rollout_data to the path ({rollout_id} formatted; eval_<id> for evaluations)"
    ),
    "dump_details": Refused("not yet supported by the Titan backend; drop the flag"),
    **_group(
        Refused(_DEBUG),
        "dumper_enable dumper_dir dumper_inference dumper_fwd_only "
        "dumper_fwd_bwd dumper_source_patcher_config_inference "
        "dumper_source_patcher_config_train memory_snapshot_dir memory_snapshot_num_steps "
        "profile_target memory_recorder record_memory_history check_weight_update_equal "
        "check_weight_update_selector check_weight_update_skip_list "
        "check_weight_update_allow_quant_error save_local_weight_checksum "
        "enable_event_analyzer env_report",
    ),  # fmt: skip
    "http_proxy": NoEffect("Titan's engines are on the job's own network; no proxy is used"),
    "use_distributed_post": NoEffect("Titan's rollout client posts from the rollout manager"),
    # ---- rewards ---------------------------------------------------------------------------
    "rm_type": _acts("slime's / miles' own rm_hub scores each sample by this type"),
    "rm_url": _acts("the remote_rm endpoint (rm_hub)"),
    "reward_key": _acts("the reward's key when a reward function returns a dict"),
    "eval_reward_key": _acts("the same, for evaluations"),
    "group_rm": _acts("the reward function scores a whole group at once"),
    "custom_rm_path": _acts("loaded with load_function; called as rm_hub calls it"),
    "custom_reward_post_process_path": _acts("replaces the group normalisation (slime's hook)"),
    "custom_convert_samples_to_train_data_path": _acts("replaces the conversion (slime's hook)"),
    # ---- rollout buffer, plugins, MTP, SGLang, CI, sessions -------------------------------------
    **_group(
        Refused("slime's external rollout buffer is not supported; drop the flag"),
        "rollout_buffer_url fetch_trajectory_retry_times min_batch_collection_ratio "
        "rollout_task_type disable_rollout_trim_samples use_dynamic_global_batch_size",
    ),  # fmt: skip
    "loss_mask_type": Refused(
        "multi-turn loss masks come from the generate hook's samples (Sample.loss_mask); "
        "drop the flag"
    ),
    "data_pad_size_multiplier": NoEffect("Titan pads micro-batches to their longest row"),
    "rollout_sample_filter_path": Refused("use rollout.dynamic_filter in the Titan YAML"),
    "rollout_all_samples_process_path": Refused("use --custom-convert-samples-to-train-data-path"),
    **_group(
        Refused("Megatron plugins are not loaded by the Titan backend; drop the flag"),
        "custom_megatron_init_path custom_megatron_before_log_prob_hook_path "
        "custom_megatron_before_train_step_hook_path megatron_deepgemm_forward_layers "
        "megatron_deepgemm_forward_modules megatron_deepgemm_moe_forward_layers "
        "megatron_deepgemm_moe_forward_modules",
    ),  # fmt: skip
    **_group(
        Refused("multi-token prediction is not supported; drop the flag"),
        "mtp_num_layers mtp_loss_scaling_factor enable_mtp_training",
    ),
    "prefill_num_servers": Refused("prefill / decode disaggregation is not supported"),
    "sglang_server_concurrency": _acts("generate requests in flight at once"),
    "sglang_config": Refused("use --sglang-<flag> options"),
    **_group(
        NoEffect("slime's / miles' CI checks; Titan's tests check the same against references"),
        "ci_test ci_disable_kl_checker ci_disable_logprobs_checker "
        "ci_disable_weight_update_checker ci_metric_checker_key ci_metric_checker_threshold "
        "ci_save_grad_norm ci_load_grad_norm ci_save_model_hash ci_check_model_hash "
        "ci_train_rollout_logprob_abs_diff_threshold ci_inject_rollout_data_path "
        "ci_inject_rollout_data_start_rollout_id ci_inject_rollout_data_min_match_ratio",
    ),  # fmt: skip
    **_group(
        Refused("miles' session server is not supported; use rollout.generate_fn"),
        "use_session_server session_server_ip session_server_port tito_model "
        "session_message_matcher session_sample_picker_path "
        "session_sample_postprocessor_path",
    ),  # fmt: skip
    "custom_config_path": _acts("YAML whose keys are set on args (slime's rule)"),
    "padded_vocab_size": NoEffect(
        "Titan pads the vocabulary itself (make_vocab_size_divisible_by x TP) and exports the "
        "HF vocabulary to the engines"
    ),
}


#: flag families generated from packages absent here (sglang's ServerArgs, sglang-router's
#: RouterArgs), matched by prefix: see :mod:`adapters.common.peer_flags`
FAMILIES: dict[str, Entry] = {
    "--sglang-": _acts(
        "passed to sglang.launch_server as --<name> where the engines are SGLang servers; "
        "on the built-in engine (CPU) a start-up line names it: no such setting there"
    ),
    "--router-": _acts(
        "passed to sglang-router as --<name> where a run has a router (more than one "
        "engine); with one engine a start-up line names it: no router runs"
    ),
}


#: rows of one framework's driver that differ from :data:`FLAG_TABLE` (a flag both declare
#: that only that driver acts on); the other framework's driver keeps the shared row
FRAMEWORK_ROWS: dict[str, dict[str, Entry]] = {
    "miles": {
        "use_fault_tolerance": _acts(
            "rollout fault tolerance (miles' default --ft-components rollout): a dead engine is "
            "restarted by its supervisor (titan_rl.actors) and, before the next weight update, "
            "reported new by the rollout manager (miles' recover_updatable_engines), so the "
            "update reconnects and sends it the current weights"
        ),
        "dump_details": _acts(
            "miles' dumps under the folder, by miles' own functions: rollout_data/<id>.pt with "
            "trajectory/ and dashboard_columns/ per rollout and evaluation, "
            "train_data/<id>_<rank>.pt per trainer rank, events/, the tokenizer"
        ),
    },
}


def entry_for(dest: str, flag: str, framework: str | None = None) -> Entry | None:
    """The class of one flag: ``framework``'s own row (:data:`FRAMEWORK_ROWS`), else its row
    in :data:`FLAG_TABLE`, else its family's, else None."""
    own = FRAMEWORK_ROWS.get(framework or "", {})
    if dest in own:
        return own[dest]
    if dest in FLAG_TABLE:
        return FLAG_TABLE[dest]
    for prefix, entry in FAMILIES.items():
        if flag.startswith(prefix):
            return entry
    return None
