"""What pretraining and the RL policy trainer build the same way: the DDP-wrapped model chunks,
megatron-core's optimizer and LR scheduler with the hooks its schedules call, and their
checkpoint load and save.

The order of the steps is the order of RNG use (weights are initialized as the chunks are
built), so a model built here is the same whichever trainer builds it from the same seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from titan_core.accelerator import Accelerator, megatron_scope
from titan_core.checkpoint import load_checkpoint, save_checkpoint, saved_vocab_rows
from titan_core.config.pretrain import PretrainConfig
from titan_core.models.gpt import (
    build_model_chunks,
    build_transformer_config,
    layers_per_stage,
    padded_vocab_size,
)
from titan_core.training.optim import build_optimizer, build_scheduler


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint to load: its folder and iteration; ``resume``: the run's own (optimizer
    and scheduler state too), else its weights alone (initial weights of a new run)."""

    root: Path
    iteration: int
    resume: bool


@dataclass(frozen=True)
class TrainingSetup:
    """The pieces a trainer steps: ``model`` is the DDP-wrapped chunks (one per virtual
    pipeline stage), ``vocab_size`` the padded vocabulary they were built with."""

    tf: TransformerConfig
    model: list[DistributedDataParallel]
    optimizer: Any  # megatron-core's MegatronOptimizer (or a chained one)
    scheduler: OptimizerParamScheduler
    vocab_size: int

    def load(self, source: CheckpointSource) -> dict[str, Any]:
        """Load ``source``'s weights; a resume loads the optimizer and scheduler state too.
        Returns the checkpoint's common state (step, data position, ...; {} for weights)."""
        if not source.resume:
            load_checkpoint(source.root, source.iteration, self.model, optimizer=None)
            return {}
        common = load_checkpoint(source.root, source.iteration, self.model, self.optimizer)
        self.scheduler.load_state_dict(common["scheduler"])
        return common

    def save(
        self,
        root: Path,
        step: int,
        common: dict[str, Any],
        keep_last: int,
        retain_interval: int | None = None,
    ) -> None:
        """Save the model, optimizer and scheduler state (with ``common``, whose ``step``
        if any overrides ``step``) as iteration ``step`` under ``root``, keeping the newest
        ``keep_last`` (0: all) and, with ``retain_interval``, what Megatron-LM's
        ``--save-retain-interval`` keeps (``titan_core.checkpoint.dist.save_checkpoint``)."""
        state = {"step": step, **common, "scheduler": self.scheduler.state_dict()}
        save_checkpoint(
            root, step, self.model, self.optimizer, state,
            keep_last=keep_last, retain_interval=retain_interval,
        )  # fmt: skip


@megatron_scope()
def wrap_model(cfg: PretrainConfig, tf: TransformerConfig, chunks: list) -> list:
    """Float16Module for bf16/fp16, then megatron-core's DDP, as megatron's get_model does."""
    if cfg.train.bf16 or cfg.train.fp16:
        chunks = [Float16Module(tf, c) for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=cfg.train.bf16 or cfg.train.fp16,
        overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
        overlap_param_gather=cfg.parallel.overlap_param_gather,
        use_distributed_optimizer=cfg.parallel.use_distributed_optimizer,
    )
    wrapped = [
        DistributedDataParallel(tf, ddp_config, c, disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]
    for w in wrapped:
        w.broadcast_params()
    return wrapped


def configure_schedule_hooks(tf: TransformerConfig, model: list, optimizer: Any) -> None:
    """The hooks megatron's schedules call: grad sync control, finalize, loss scaling."""
    no_sync = [m.no_sync for m in model]
    tf.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if model[0].ddp_config.overlap_grad_reduce:
        grad_sync = [m.start_grad_sync for m in model]
        tf.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    if model[0].ddp_config.overlap_param_gather:
        param_sync = [m.start_param_sync for m in model]
        tf.param_sync_func = param_sync[0] if len(model) == 1 else param_sync
    tf.finalize_model_grads_func = finalize_model_grads
    tf.grad_scale_func = optimizer.scale_loss


def build_training(
    cfg: PretrainConfig,
    accel: Accelerator,
    vocab_size: int,
    source: CheckpointSource | None = None,
    routing_replay: bool = False,
) -> TrainingSetup:
    """The model (padded ``vocab_size``; the rows ``source`` was saved with, when given, so it
    loads at any TP), DDP, optimizer, scheduler and schedule hooks, on this rank;
    ``routing_replay``: MoE routers with megatron-core's ``RouterReplay`` (RL)."""
    rows = saved_vocab_rows(source.root, source.iteration) if source else None
    vocab = padded_vocab_size(vocab_size, cfg, rows)
    tf = build_transformer_config(cfg, accel, routing_replay)
    if tf.pipeline_model_parallel_size > 1 and torch.distributed.get_rank() == 0:
        split = ", ".join(map(str, layers_per_stage(tf)))
        print(f"layers per pipeline stage: {split}", flush=True)
    chunks = build_model_chunks(cfg, tf, vocab, accel)
    model = wrap_model(cfg, tf, chunks)
    optimizer = build_optimizer(cfg, model)
    scheduler = build_scheduler(cfg, optimizer)
    configure_schedule_hooks(tf, model, optimizer)
    return TrainingSetup(tf, model, optimizer, scheduler, vocab)
