"""Megatron-LM's own flags that slime's and miles' launch scripts pass.

Both frameworks parse their command line with Megatron-LM's ``parse_args`` plus their own
flags; Megatron-LM's parser (``megatron/training/arguments.py``) is in Megatron-LM's source
tree, not in the megatron-core wheel, so it is not installed anywhere a CPU machine can read
it. These are its flags that the frameworks' scripts use (model shape, MoE, parallelism,
recompute, optimizer and schedule, precision, kernels), under Megatron-LM's names, types and
defaults. A Megatron-LM flag not listed here is refused by argparse, naming it.
"""

from __future__ import annotations

from typing import Any

from adapters.common.peer_flags import FlagSpec


def _flag(
    name: str, type: str = "str", default: Any = None, section: str = "", **kw: Any
) -> FlagSpec:
    options = tuple(kw.pop("options", ())) or (name,)
    dest = kw.pop("dest", name.lstrip("-").replace("-", "_"))
    return FlagSpec(options=options, dest=dest, type=type, default=default, section=section,
                    source="megatron-lm", **kw)  # fmt: skip


def _true(name: str, section: str, **kw: Any) -> FlagSpec:
    return _flag(name, action="store_true", default=False, section=section, **kw)


def _false(name: str, dest: str, section: str) -> FlagSpec:
    return _flag(name, action="store_false", default=True, dest=dest, section=section)


_M, _E, _P, _R, _O, _X, _K = (
    "model",
    "moe",
    "parallel",
    "recompute",
    "optimizer",
    "precision",
    "kernels",
)

MEGATRON_FLAGS: tuple[FlagSpec, ...] = (
    # model shape
    _flag("--num-layers", "int", section=_M),
    _flag("--hidden-size", "int", section=_M),
    _flag("--ffn-hidden-size", "int", section=_M),
    _flag("--num-attention-heads", "int", section=_M),
    _true("--group-query-attention", _M),
    _flag("--num-query-groups", "int", 1, _M),
    _flag("--kv-channels", "int", section=_M),
    _flag("--seq-length", "int", section=_M),
    _flag("--max-position-embeddings", "int", section=_M),
    _true("--swiglu", _M),
    _flag("--normalization", "str", "LayerNorm", _M, choices=("LayerNorm", "RMSNorm")),
    _flag("--norm-epsilon", "float", 1e-5, _M),
    _true("--use-rotary-position-embeddings", _M),
    _flag(
        "--position-embedding-type",
        "str",
        "learned_absolute",
        _M,
        choices=("learned_absolute", "rope", "mrope", "relative", "none"),
    ),  # fmt: skip
    _flag("--rotary-base", "int", 10000, _M),
    _flag("--rotary-percent", "float", 1.0, _M),
    _flag("--vocab-size", "int", section=_M),
    _flag("--make-vocab-size-divisible-by", "int", 128, _M),
    _true("--qk-layernorm", _M),
    _false("--disable-bias-linear", "add_bias_linear", _M),
    _true("--add-qkv-bias", _M),
    _true("--untie-embeddings-and-output-weights", _M),
    _flag("--init-method-std", "float", 0.02, _M),
    _flag("--hidden-dropout", "float", 0.1, _M),
    _flag("--attention-dropout", "float", 0.1, _M),
    # MoE
    _flag("--num-experts", "int", section=_E),
    _flag("--moe-ffn-hidden-size", "int", section=_E),
    _flag("--moe-router-topk", "int", 2, _E),
    _flag("--moe-router-score-function", "str", "softmax", _E, choices=("softmax", "sigmoid")),
    _flag(
        "--moe-token-dispatcher-type",
        "str",
        "allgather",
        _E,
        choices=("allgather", "alltoall", "flex"),
    ),  # fmt: skip
    _flag("--moe-layer-freq", "moe_freq", 1, _E),
    _true("--moe-grouped-gemm", _E),
    _flag("--moe-token-drop-policy", "str", "probs", _E, choices=("probs", "position")),
    _flag("--moe-router-dtype", "str", None, _E, choices=("fp32", "fp64")),
    _true("--moe-permute-fusion", _E),
    _flag("--moe-aux-loss-coeff", "float", 0.0, _E),
    _flag(
        "--moe-router-load-balancing-type",
        "str",
        "aux_loss",
        _E,
        choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
    ),  # fmt: skip
    _flag("--moe-shared-expert-intermediate-size", "int", section=_E),
    _true("--moe-shared-expert-overlap", _E),
    _true("--moe-router-enable-expert-bias", _E),
    _flag("--moe-router-bias-update-rate", "float", 1e-3, _E),
    _flag("--moe-expert-capacity-factor", "float", section=_E),
    _true("--moe-pad-expert-input-to-capacity", _E),
    _flag("--moe-flex-dispatcher-backend", "str", "deepep", _E, choices=("deepep", "hybridep")),
    _true("--moe-router-padding-for-quantization", _E),
    # parallelism
    _flag("--tensor-model-parallel-size", "int", 1, _P),
    _flag("--pipeline-model-parallel-size", "int", 1, _P),
    _flag("--virtual-pipeline-model-parallel-size", "int", section=_P),
    _flag("--num-layers-per-virtual-pipeline-stage", "int", section=_P),
    _flag("--context-parallel-size", "int", 1, _P),
    _flag("--cp-comm-type", "str", "p2p", _P, nargs="+"),
    _flag("--expert-model-parallel-size", "int", 1, _P),
    _flag("--expert-tensor-parallel-size", "int", section=_P),
    _true("--sequence-parallel", _P),
    _true("--use-distributed-optimizer", _P),
    _true("--overlap-grad-reduce", _P),
    _true("--overlap-param-gather", _P),
    _flag("--decoder-first-pipeline-num-layers", "int", section=_P),
    _flag("--decoder-last-pipeline-num-layers", "int", section=_P),
    # activation recompute
    _flag("--recompute-granularity", "str", section=_R, choices=("full", "selective")),
    _flag("--recompute-method", "str", section=_R, choices=("uniform", "block")),
    _flag("--recompute-num-layers", "int", section=_R),
    _flag("--recompute-modules", "str", section=_R, nargs="*"),
    # optimizer and schedule
    _flag("--optimizer", "str", "adam", _O, choices=("adam", "sgd")),
    _flag("--min-lr", "float", 0.0, _O),
    _flag(
        "--lr-decay-style",
        "str",
        "linear",
        _O,
        choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"),
    ),  # fmt: skip
    _flag("--lr-warmup-iters", "int", 0, _O),
    _flag("--lr-warmup-fraction", "float", section=_O),
    _flag("--lr-decay-iters", "int", section=_O),
    _flag("--weight-decay", "float", 0.01, _O),
    _flag("--adam-beta1", "float", 0.9, _O),
    _flag("--adam-beta2", "float", 0.999, _O),
    _flag("--adam-eps", "float", 1e-8, _O),
    _true("--optimizer-cpu-offload", _O),
    _true("--overlap-cpu-optimizer-d2h-h2d", _O),
    _true("--use-precision-aware-optimizer", _O),
    # precision
    _true("--bf16", _X),
    _true("--fp16", _X),
    _flag("--fp8-format", "str", section=_X, choices=("e4m3", "hybrid")),
    _flag(
        "--fp8-recipe",
        "str",
        "delayed",
        _X,
        choices=("delayed", "tensorwise", "mxfp8", "blockwise"),
    ),  # fmt: skip
    _true("--fp8-param-gather", _X),
    _flag("--fp4-format", "str", section=_X),
    _flag("--fp4-recipe", "str", section=_X),
    _flag("--te-precision-config-file", "str", section=_X),
    _true("--accumulate-allreduce-grads-in-fp32", _X),
    _true("--attention-softmax-in-fp32", _X),
    _true("--reuse-grad-buf-for-mxfp8-param-ag", _X),
    # implementation and kernels
    _flag(
        "--transformer-impl",
        "str",
        "transformer_engine",
        _K,
        choices=("local", "transformer_engine", "inference_optimized"),
    ),  # fmt: skip
    _flag(
        "--attention-backend",
        "str",
        "auto",
        _K,
        choices=("flash", "fused", "unfused", "local", "auto"),
    ),  # fmt: skip
    _true("--use-cpu-initialization", _K),
    _false("--no-gradient-accumulation-fusion", "gradient_accumulation_fusion", _K),
    _false("--no-masked-softmax-fusion", "masked_softmax_fusion", _K),
    _false("--no-bias-swiglu-fusion", "bias_swiglu_fusion", _K),
    _false("--no-rope-fusion", "apply_rope_fusion", _K),
    _true("--cross-entropy-loss-fusion", _K),
    # checkpoints and logging
    _flag("--ckpt-format", "str", "torch_dist", "checkpoints", choices=("torch", "torch_dist")),
    _true("--no-load-optim", "checkpoints"),
    _true("--no-load-rng", "checkpoints"),
    _true("--finetune", "checkpoints"),
    _flag("--save-retain-interval", "int", section="checkpoints"),
    _flag("--log-interval", "int", 100, "logging"),
    _flag("--tensorboard-dir", "str", section="logging"),
)
