"""megatron-core's optimizer (optionally distributed) and LR/WD scheduler from config."""

from __future__ import annotations

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from titan_core.accelerator import megatron_scope
from titan_core.config.pretrain import PretrainConfig


@megatron_scope()
def build_optimizer(cfg: PretrainConfig, model: list):  # noqa: ANN201
    t = cfg.train
    config = OptimizerConfig(
        optimizer="adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        clip_grad=t.clip_grad,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=torch.bfloat16 if t.bf16 else torch.float16 if t.fp16 else torch.float32,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    return get_megatron_optimizer(config, model)


def build_scheduler(cfg: PretrainConfig, optimizer) -> OptimizerParamScheduler:  # noqa: ANN001
    """Megatron's scheduler, counted in samples as megatron's training loop counts it."""
    t = cfg.train
    gbs = t.global_batch_size
    decay_iters = t.lr_decay_iters or t.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=t.lr,
        min_lr=t.min_lr,
        lr_warmup_steps=t.lr_warmup_iters * gbs,
        lr_decay_steps=decay_iters * gbs,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=t.train_iters * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=(decay_iters * gbs) // 10 if t.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if t.lr_decay_style == "WSD" else None,
    )
