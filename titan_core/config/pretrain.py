"""The pretraining config: Megatron's own argument names, grouped in sections.

A megatron user finds ``--num-layers`` as ``model.num_layers``, ``--tensor-model-parallel-size``
as ``parallel.tensor_model_parallel_size`` and so on. Layout checks that need the world
size (divisibility by TP x PP x CP, ...) run in :func:`check_layout` before any process
group starts.
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings
from typing import Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from titan_core.config.loader import ConfigError, Section

_SPLIT_PART = re.compile(r"\d+(\.\d*)?|\.\d+")


class ModelConfig(Section):
    num_layers: PositiveInt = 4
    hidden_size: PositiveInt = 128
    num_attention_heads: PositiveInt = 4
    num_query_groups: PositiveInt | None = None
    ffn_hidden_size: PositiveInt | None = None
    kv_channels: PositiveInt | None = None
    seq_length: PositiveInt = 128
    max_position_embeddings: PositiveInt | None = None
    #: None: the tokenizer's vocabulary size, padded to ``make_vocab_size_divisible_by`` x TP.
    vocab_size: PositiveInt | None = None
    make_vocab_size_divisible_by: PositiveInt = 128
    normalization: Literal["LayerNorm", "RMSNorm"] = "RMSNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: Literal["rope", "learned_absolute", "none"] = "rope"
    rotary_base: float = 10000.0
    swiglu: bool = True
    add_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = Field(0.02, gt=0)
    hidden_dropout: float = Field(0.0, ge=0, lt=1)
    attention_dropout: float = Field(0.0, ge=0, lt=1)
    # MoE
    num_moe_experts: PositiveInt | None = None
    moe_router_topk: PositiveInt = 2
    moe_ffn_hidden_size: PositiveInt | None = None
    moe_shared_expert_intermediate_size: PositiveInt | None = None
    #: run the shared experts concurrently with the routed experts' token all-to-all
    #: (needs model.moe_shared_expert_intermediate_size and the alltoall dispatcher).
    moe_shared_expert_overlap: bool = False
    #: the router's score function; the aux-loss-free expert bias needs sigmoid.
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    #: aux-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the routing
    #: scores, moved each step toward the under-loaded experts (needs sigmoid scores).
    moe_router_enable_expert_bias: bool = False
    #: how far each step moves an expert's bias (sign of its load below/above the mean).
    moe_router_bias_update_rate: float = Field(1e-3, gt=0)
    #: tokens an expert takes per step, as a multiple of an even share (topk x tokens /
    #: experts); the rest are dropped. None: no capacity limit, no dropping.
    moe_expert_capacity_factor: float | None = Field(None, gt=0)
    #: which tokens an over-capacity expert drops: lowest routing probability or latest position.
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    #: pad every expert's input to its full capacity (static shapes; needs a capacity factor).
    moe_pad_expert_input_to_capacity: bool = False
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = (
        "aux_loss"
    )
    moe_aux_loss_coeff: float = Field(1e-2, ge=0)
    moe_router_dtype: Literal["fp32", "fp64"] | None = "fp32"
    moe_grouped_gemm: bool = False
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "alltoall"
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] = "deepep"
    moe_layer_freq: PositiveInt = 1
    #: "local" (megatron-core's torch layers), "transformer_engine", or "auto" (TE if present).
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_query_groups and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        if self.num_moe_experts and self.moe_router_topk > self.num_moe_experts:
            raise ValueError(
                f"model.moe_router_topk ({self.moe_router_topk}) exceeds "
                f"model.num_moe_experts ({self.num_moe_experts})"
            )
        if self.max_position_embeddings and self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"model.seq_length ({self.seq_length}) exceeds model.max_position_embeddings "
                f"({self.max_position_embeddings}); lower seq_length or raise "
                "max_position_embeddings"
            )
        return self

    @model_validator(mode="after")
    def _check_moe_router(self) -> ModelConfig:
        """Router combinations megatron-core 0.16.1 rejects, named by Titan's keys."""
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            raise ValueError(
                "model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid"
            )
        capacity = self.moe_expert_capacity_factor
        if capacity is not None and self.moe_router_load_balancing_type == "sinkhorn":
            raise ValueError(
                "model.moe_expert_capacity_factor does not work with "
                "model.moe_router_load_balancing_type=sinkhorn; use aux_loss, seq_aux_loss or none"
            )
        if self.moe_pad_expert_input_to_capacity:
            if capacity is None:
                raise ValueError(
                    "model.moe_pad_expert_input_to_capacity needs model.moe_expert_capacity_factor"
                )
            if self.moe_token_dispatcher_type == "flex" and self.moe_flex_dispatcher_backend == (
                "deepep"
            ):
                raise ValueError(
                    "model.moe_pad_expert_input_to_capacity is not supported by "
                    "model.moe_token_dispatcher_type=flex with DeepEP; use alltoall or allgather"
                )
        if self.moe_shared_expert_overlap:
            if self.moe_shared_expert_intermediate_size is None:
                raise ValueError(
                    "model.moe_shared_expert_overlap needs shared experts: set "
                    "model.moe_shared_expert_intermediate_size"
                )
            if self.moe_token_dispatcher_type != "alltoall":
                raise ValueError(
                    "model.moe_shared_expert_overlap needs model.moe_token_dispatcher_type="
                    f"alltoall (not {self.moe_token_dispatcher_type})"
                )
        return self


class ParallelConfig(Section):
    tensor_model_parallel_size: PositiveInt = 1
    pipeline_model_parallel_size: PositiveInt = 1
    virtual_pipeline_model_parallel_size: PositiveInt | None = None
    #: layers on the first / the last pipeline stage (megatron-core's uneven split, Megatron-LM's
    #: --decoder-first/last-pipeline-num-layers: e.g. fewer where the embedding or the output
    #: layer and loss sit); the other stages share the rest evenly. None: an even split.
    num_layers_in_first_pipeline_stage: PositiveInt | None = None
    num_layers_in_last_pipeline_stage: PositiveInt | None = None
    context_parallel_size: PositiveInt = 1
    expert_model_parallel_size: PositiveInt = 1
    expert_tensor_parallel_size: PositiveInt | None = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    overlap_p2p_comm: bool = False
    #: megatron's EP comm/compute overlap (needs EP > 1, alltoall/flex, bf16, VPP when PP > 1).
    overlap_moe_expert_parallel_comm: bool = False
    delay_wgrad_compute: bool = False
    distributed_timeout_minutes: PositiveInt = 10
    #: how activations and gradients move between pipeline stages (PP > 1): torch
    #: (megatron-core's torch.distributed send/recv) or mooncake (Mooncake TransferEngine
    #: writes into registered buffers, sends overlapped with compute).
    p2p_transport: Literal["torch", "mooncake"] = "torch"
    #: p2p_transport mooncake: seconds a pipeline send or receive may wait for its peer
    #: stage before the step fails with an error naming that stage.
    p2p_timeout_s: float = Field(300.0, gt=0)
    #: p2p_transport mooncake: this node's address for Mooncake's TCP listener; None: the
    #: node's address as found at start-up (TITAN_NODE_IP, torchrun's --local-addr, the route
    #: to the rendezvous host across nodes), else the address the host name resolves to.
    p2p_mooncake_host: str | None = None

    @model_validator(mode="after")
    def _check_p2p(self) -> ParallelConfig:
        if self.p2p_transport == "mooncake":
            _require_mooncake()
            if self.pipeline_model_parallel_size == 1:
                warnings.warn(
                    "parallel.p2p_transport=mooncake has no effect with "
                    "parallel.pipeline_model_parallel_size=1 (no pipeline stages to connect)",
                    stacklevel=2,
                )
        return self


def _require_mooncake() -> None:
    try:
        found = importlib.util.find_spec("mooncake.engine") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ValueError(
            "parallel.p2p_transport=mooncake needs Mooncake's TransferEngine: pip install "
            "mooncake-transfer-engine (or mooncake-transfer-engine-non-cuda on hosts "
            "without CUDA), or set parallel.p2p_transport=torch"
        )


#: Megatron's LR decay styles
LrDecayStyle = Literal["constant", "linear", "cosine", "WSD"]


class TrainFields(Section):
    """What pretraining's ``train`` section and RL's (``titan_rl.config.RLTrainConfig``)
    share: the micro batch, the optimizer, the LR schedule, precision, FP8, activation offload
    and recompute, under Megatron's names. The batch, the length, the seed, logging and
    evaluation are each job's own (pretraining: :class:`TrainConfig`; RL: ``rollout.*``,
    ``run.*``)."""

    micro_batch_size: PositiveInt = 8
    lr: float = Field(1e-3, gt=0)
    min_lr: float = Field(1e-4, ge=0)
    lr_warmup_iters: int = Field(20, ge=0)
    lr_decay_iters: PositiveInt | None = None
    lr_decay_style: LrDecayStyle = "cosine"
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.95, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    clip_grad: float = Field(1.0, ge=0)
    bf16: bool = False
    fp16: bool = False
    #: FP8 training ("e4m3" / "hybrid": e5m2 gradients): on GPU megatron-core with Transformer
    #: Engine; on CPU the blockwise recipe emulated in plain torch (titan_core/fp8).
    fp8: Literal["e4m3", "hybrid"] | None = None
    #: the FP8 scaling recipe; blockwise is TE's Float8BlockScaling (the only one on CPU).
    fp8_recipe: Literal["delayed", "tensorwise", "mxfp8", "blockwise"] = "blockwise"
    #: megatron's fine-grained activation offloading of these modules' inputs (1F1B / VPP
    #: aware): attn_norm, qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm, and
    #: for MoE expert_fc1, moe_act. bench/activation_offload.py measures each.
    offload_modules: list[
        Literal[
            "attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1",
            "moe_act",
        ]
    ] = Field(default_factory=list)  # fmt: skip
    #: tensors with fewer elements than this stay resident under train.offload_modules
    #: (megatron's min_offloaded_tensor_size).
    offload_min_tensor_size: int = Field(1024 * 1024, ge=0)
    #: megatron's activation recompute: "selective" recomputes train.recompute_modules in
    #: backward instead of saving their activations; "full" recomputes whole layers
    #: (train.recompute_method, train.recompute_num_layers). None: everything is saved.
    recompute_granularity: Literal["full", "selective"] | None = None
    #: full recompute: "uniform" (every layer, in units of recompute_num_layers) or "block"
    #: (the first recompute_num_layers layers of each pipeline stage).
    recompute_method: Literal["uniform", "block"] | None = None
    #: full recompute: layers per unit (uniform) or per stage (block).
    recompute_num_layers: PositiveInt | None = None
    #: selective recompute: core_attn, mlp (the dense MLP), layernorm, moe, moe_act (grouped
    #: GEMM experts), shared_experts, mla_up_proj (megatron's choices).
    recompute_modules: list[
        Literal["core_attn", "mlp", "layernorm", "moe", "moe_act", "shared_experts", "mla_up_proj"]
    ] = Field(default_factory=lambda: ["core_attn"])

    @model_validator(mode="after")
    def _check_recompute(self) -> TrainFields:
        full = self.recompute_granularity == "full"
        if full and (self.recompute_method is None or self.recompute_num_layers is None):
            raise ValueError(
                "train.recompute_granularity=full needs train.recompute_method (uniform or "
                "block) and train.recompute_num_layers"
            )
        if not full and (self.recompute_method or self.recompute_num_layers):
            raise ValueError(
                "train.recompute_method and train.recompute_num_layers apply to "
                "train.recompute_granularity=full only; selective recompute uses "
                "train.recompute_modules"
            )
        if self.recompute_granularity == "selective" and not self.recompute_modules:
            raise ValueError(
                "train.recompute_granularity=selective needs train.recompute_modules (e.g. [mlp])"
            )
        return self

    @model_validator(mode="after")
    def _check_precision_and_lr(self) -> TrainFields:
        if self.bf16 and self.fp16:
            raise ValueError("train.bf16 and train.fp16 are exclusive; set one of them")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr ({self.min_lr}) exceeds train.lr ({self.lr})")
        return self


class TrainConfig(TrainFields):
    """Pretraining's ``train`` section: the shared keys plus the batch, the length, the seed,
    logging and evaluation of a pretraining run."""

    global_batch_size: PositiveInt = 32
    train_iters: PositiveInt = 200
    seed: int = 1234
    log_interval: PositiveInt = 1
    #: evaluate every N steps and at the end (eval/loss; eval/accuracy for arithmetic_sft:
    #: teacher-forced greedy exact match on held-out problems); None: never.
    eval_interval: PositiveInt | None = None
    #: global batches per evaluation.
    eval_iters: PositiveInt = 4
    #: stop (and save) at the first evaluation whose eval/accuracy reaches this fraction;
    #: train.train_iters is then the cap. None: run all train.train_iters steps.
    stop_at_eval_accuracy: float | None = Field(None, gt=0, le=1)

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.stop_at_eval_accuracy is not None and not self.eval_interval:
            raise ValueError(
                "train.stop_at_eval_accuracy needs evaluations: set train.eval_interval (e.g. 25)"
            )
        decay = self.lr_decay_iters or self.train_iters
        if self.lr_warmup_iters >= decay:
            raise ValueError(
                f"train.lr_warmup_iters ({self.lr_warmup_iters}) must be below the decay length "
                f"(train.lr_decay_iters or train.train_iters = {decay}); lower lr_warmup_iters"
            )
        return self


class TokenizerFields(Section):
    """The tokenizer keys pretraining and RL share (``data.tokenizer_*``)."""

    #: byte: Titan's byte-level tokenizer (nothing to load); hf: an HF tokenizer.
    tokenizer_type: Literal["byte", "hf"] = "byte"
    #: tokenizer_type hf: a tokenizer.json file or an HF directory (never downloaded).
    tokenizer_model: str | None = None

    @model_validator(mode="after")
    def _check_tokenizer(self) -> TokenizerFields:
        if self.tokenizer_type == "hf" and not self.tokenizer_model:
            raise ValueError(
                "data.tokenizer_model (a tokenizer.json file or HF directory) is required "
                "when data.tokenizer_type=hf"
            )
        return self


class ArithmeticFields(Section):
    """The keys of the generated a+b=c problems pretraining and RL share."""

    #: digits per operand.
    num_digits: PositiveInt = 3
    #: "plain" (57+8=65) or "aligned" (57+08=560: padded, sum reversed).
    arithmetic_format: Literal["plain", "aligned"] = "plain"


class DataConfig(TokenizerFields, ArithmeticFields):
    #: arithmetic: generated a+b=c corpus (learnable, no download), packed, loss on every
    #: token; arithmetic_sft: the same problems one per row, loss on the answer only (what
    #: a model that must answer them needs: see titan_core/data/sft.py); indexed: Megatron
    #: .bin/.idx files from ``titan_core.data.preprocess``; synthetic: a fixed random-walk
    #: corpus for tests.
    type: Literal["arithmetic", "arithmetic_sft", "indexed", "synthetic"] = "arithmetic"
    #: Megatron blend: ["path_prefix"] or ["w1", "prefix1", "w2", "prefix2"].
    data_path: list[str] = Field(default_factory=list)
    #: train,validation,test weights (Megatron's --split).
    split: str = "98,2,0"
    #: arithmetic corpus: number of problems.
    num_samples: PositiveInt = 200_000
    #: where built datasets and their index cache go (None: ``<run.dir>/data``).
    cache_dir: str | None = None
    #: arithmetic_sft: share of rows written as calculator transcripts
    #: (``123+456=CALC(123+456)=579 579``, no loss on the calculator's ``=579``; see
    #: titan_core/data/calc_transcript.py) instead of direct answers; 0: direct answers only.
    tool_fraction: float = Field(0.0, ge=0.0, le=1.0)

    @field_validator("data_path", mode="before")
    @classmethod
    def _weights_as_text(cls, value: object) -> object:
        """``[0.3, a, 0.7, b]`` as YAML reads it: the weights come as numbers."""
        if isinstance(value, list):
            return [str(v) if isinstance(v, int | float) else v for v in value]
        return value

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        if self.type == "indexed" and not self.data_path:
            raise ValueError("data.data_path is required when data.type=indexed")
        if self.tool_fraction > 0 and (
            self.type != "arithmetic_sft" or self.arithmetic_format != "plain"
        ):
            raise ValueError(
                "data.tool_fraction needs data.type=arithmetic_sft and "
                "data.arithmetic_format=plain (calculator transcripts answer the plain sum); "
                f"got data.type={self.type}, data.arithmetic_format={self.arithmetic_format}"
            )
        self.split_weights()
        self.blend()
        return self

    def split_weights(self) -> list[float]:
        """``data.split`` as (train, validation, test) weights, in megatron's reading of it."""
        parts = [p.strip() for p in self.split.split(",")]
        if not 1 <= len(parts) <= 3 or not all(_SPLIT_PART.fullmatch(p) for p in parts):
            raise ValueError(
                f"data.split {self.split!r} must be up to three non-negative numbers "
                "separated by commas: train,validation,test weights, e.g. 98,2,0"
            )
        weights = [float(p) for p in parts] + [0.0] * (3 - len(parts))
        if weights[0] <= 0:
            raise ValueError(
                f"data.split {self.split!r} gives training no share; make its first weight "
                "positive, e.g. 98,2,0"
            )
        return weights

    def blend(self) -> tuple[list[str], list[float] | None]:
        """``data.data_path`` as megatron's blend: (prefixes, weights or None)."""
        paths = self.data_path
        if len(paths) <= 1:
            return list(paths), None
        hint = "data.data_path must be one prefix or pairs of weight and prefix: [w1, p1, w2, p2]"
        if len(paths) % 2:
            raise ValueError(hint)
        try:
            weights = [float(w) for w in paths[0::2]]
        except ValueError:
            raise ValueError(f"{hint}; got {paths}") from None
        if not all(math.isfinite(w) and w > 0 for w in weights):
            raise ValueError(f"data.data_path weights must be positive numbers; got {weights}")
        return list(paths[1::2]), weights


class CheckpointConfig(Section):
    #: save every N steps (0: only at the end).
    save_interval: int = Field(50, ge=0)
    #: where to save; default ``<run.dir>/checkpoints``.
    save: str | None = None
    #: where to resume from; default: the save directory (auto-resume).
    load: str | None = None
    #: keep this many newest checkpoints (0: all).
    keep_last: int = Field(2, ge=0)
    #: resume automatically from the latest complete checkpoint.
    auto_resume: bool = True
    #: on SIGTERM / SIGINT, finish the current step, save it and exit 143 / 130 (what
    #: Megatron-LM's --exit-signal-handler does for SIGTERM); false: exit without saving.
    save_on_signal: bool = True
    #: start from these model weights (a checkpoint folder holding the tracker file) when
    #: there is nothing to resume; the step count, optimizer and data start afresh.
    pretrained_checkpoint: str | None = None
    #: dist_checkpointing format ("torch_dist" is resharding-capable).
    format: Literal["torch_dist"] = "torch_dist"


class ProfileConfig(Section):
    #: global steps to profile, e.g. [3, 4]; empty: off.
    steps: list[PositiveInt] = Field(default_factory=list)
    #: default ``<run.dir>/traces``.
    dir: str | None = None
    #: record Python stacks with each op (larger traces).
    with_stack: bool = False


class RunConfig(Section):
    #: the run's folder: checkpoints, metrics.jsonl, traces (one job at a time).
    dir: str = "runs/pretrain"
    #: a label for the run, kept in the config its checkpoints save.
    name: str | None = None


def _check_layer_split(p: ParallelConfig, num_layers: int) -> None:
    """The layers split over the pipeline stages (and each stage's virtual chunks) as
    megatron-core splits them: evenly, or with ``num_layers_in_first/last_pipeline_stage``
    first and the rest evenly over the other stages."""
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    ends = {"first": p.num_layers_in_first_pipeline_stage,
            "last": p.num_layers_in_last_pipeline_stage}  # fmt: skip
    given = {k: v for k, v in ends.items() if v is not None}
    if not given:
        if num_layers % (pp * vpp):
            raise ValueError(
                f"model.num_layers ({num_layers}) must be divisible by "
                f"parallel.pipeline_model_parallel_size x virtual_pipeline_model_parallel_size "
                f"({pp * vpp}), or set parallel.num_layers_in_first_pipeline_stage / "
                "num_layers_in_last_pipeline_stage for an uneven split"
            )
        return
    keys = " and ".join(f"parallel.num_layers_in_{k}_pipeline_stage" for k in given)
    if pp < 2:
        verb = "need" if len(given) > 1 else "needs"
        raise ValueError(f"{keys} {verb} parallel.pipeline_model_parallel_size >= 2")
    for k, n in given.items():
        if n % vpp:
            raise ValueError(
                f"parallel.num_layers_in_{k}_pipeline_stage ({n}) must be divisible by "
                f"parallel.virtual_pipeline_model_parallel_size ({vpp}): each stage's layers "
                "are split over its virtual chunks"
            )
    rest_stages = pp - len(given)
    rest = num_layers - sum(given.values())
    if rest_stages == 0:
        if rest:
            raise ValueError(
                f"{keys} ({' + '.join(str(v) for v in given.values())}) must add up to "
                f"model.num_layers ({num_layers}) with parallel.pipeline_model_parallel_size=2"
            )
        return
    if rest < rest_stages * vpp or rest % (rest_stages * vpp):
        raise ValueError(
            f"the {rest} layers {keys} leave (model.num_layers={num_layers}) must split "
            f"evenly, at least one each, over the other {rest_stages} pipeline stage(s) x "
            f"{vpp} virtual chunk(s)"
        )


class PretrainConfig(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _check_static_layout(self) -> PretrainConfig:
        p, m = self.parallel, self.model
        _check_layer_split(p, m.num_layers)
        if p.virtual_pipeline_model_parallel_size and p.pipeline_model_parallel_size < 2:
            raise ValueError(
                "parallel.virtual_pipeline_model_parallel_size needs "
                "parallel.pipeline_model_parallel_size >= 2"
            )
        if m.num_attention_heads % p.tensor_model_parallel_size:
            raise ValueError(
                f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                f"parallel.tensor_model_parallel_size ({p.tensor_model_parallel_size})"
            )
        if p.expert_model_parallel_size > 1:
            if not m.num_moe_experts:
                raise ValueError(
                    "parallel.expert_model_parallel_size > 1 needs an MoE model: set "
                    "model.num_moe_experts"
                )
            if m.num_moe_experts % p.expert_model_parallel_size:
                raise ValueError(
                    f"model.num_moe_experts ({m.num_moe_experts}) must be divisible by "
                    f"parallel.expert_model_parallel_size ({p.expert_model_parallel_size})"
                )
        if p.context_parallel_size > 1:
            raise ValueError(
                "parallel.context_parallel_size > 1 is not supported yet (the data path does "
                "not split sequences across CP ranks); set it to 1"
            )
        if p.sequence_parallel and p.tensor_model_parallel_size == 1:
            raise ValueError("parallel.sequence_parallel needs tensor_model_parallel_size > 1")
        if self.train.global_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.global_batch_size ({self.train.global_batch_size}) must be divisible by "
                f"train.micro_batch_size ({self.train.micro_batch_size})"
            )
        if p.overlap_moe_expert_parallel_comm and not (self.train.bf16 or self.train.fp16):
            raise ValueError("parallel.overlap_moe_expert_parallel_comm needs train.bf16=true")
        d = self.data
        if self.train.eval_interval and d.type != "arithmetic_sft" and d.split_weights()[1] == 0:
            raise ValueError(
                f"train.eval_interval needs a validation split, but data.split {d.split!r} "
                "gives it none; give data.split a nonzero second weight (e.g. 98,2,0)"
            )
        return self

    @model_validator(mode="after")
    def _check_moe_parallel(self) -> PretrainConfig:
        """Dispatcher and EP-overlap layouts megatron-core 0.16.1 rejects, named by key."""
        p, m = self.parallel, self.model
        ep_tp = p.expert_model_parallel_size * p.tensor_model_parallel_size
        if m.num_moe_experts and m.moe_token_dispatcher_type == "flex" and ep_tp == 1:
            raise ValueError(
                "model.moe_token_dispatcher_type=flex needs parallel.expert_model_parallel_size x "
                "tensor_model_parallel_size > 1; use alltoall at EP=1"
            )
        if not p.overlap_moe_expert_parallel_comm:
            return self
        if p.expert_model_parallel_size == 1:
            raise ValueError(
                "parallel.overlap_moe_expert_parallel_comm needs "
                "parallel.expert_model_parallel_size > 1"
            )
        if m.moe_token_dispatcher_type not in ("alltoall", "flex"):
            raise ValueError(
                "parallel.overlap_moe_expert_parallel_comm needs model.moe_token_dispatcher_type "
                f"alltoall or flex (not {m.moe_token_dispatcher_type})"
            )
        if p.pipeline_model_parallel_size > 1 and not p.virtual_pipeline_model_parallel_size:
            raise ValueError(
                "parallel.overlap_moe_expert_parallel_comm with pipeline_model_parallel_size > 1 "
                "needs parallel.virtual_pipeline_model_parallel_size (megatron-core overlaps EP "
                "only in its combined-1F1B no-pipeline and interleaved schedules)"
            )
        if m.moe_shared_expert_overlap:
            raise ValueError(
                "parallel.overlap_moe_expert_parallel_comm and model.moe_shared_expert_overlap "
                "exclude each other; unset model.moe_shared_expert_overlap"
            )
        return self


def check_layout(cfg: PretrainConfig, world_size: int) -> int:
    """Check the layout against the world size; return the data-parallel size.

    Runs before any process group is created, so a bad layout costs nothing.
    """
    p, t = cfg.parallel, cfg.train
    model_parallel = (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    if world_size % model_parallel:
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor x pipeline x context parallel "
            f"size ({p.tensor_model_parallel_size} x {p.pipeline_model_parallel_size} x "
            f"{p.context_parallel_size} = {model_parallel}); change parallel.* or the number "
            "of processes"
        )
    dp = world_size // model_parallel
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    expert_mp = etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size
    if p.expert_model_parallel_size > 1 and world_size % expert_mp:
        raise ConfigError(
            f"world size {world_size} is not divisible by expert tensor x expert model x "
            f"pipeline parallel size ({expert_mp}); change parallel.expert_model_parallel_size"
        )
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"train.global_batch_size ({t.global_batch_size}) must be divisible by "
            f"train.micro_batch_size x data-parallel size ({t.micro_batch_size} x {dp}); "
            "change train.global_batch_size"
        )
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if p.virtual_pipeline_model_parallel_size and num_micro % p.pipeline_model_parallel_size:
        raise ConfigError(
            f"interleaved pipelining needs the number of microbatches ({num_micro}) to be a "
            f"multiple of parallel.pipeline_model_parallel_size "
            f"({p.pipeline_model_parallel_size}); change train.global_batch_size"
        )
    return dp
