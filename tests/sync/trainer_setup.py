"""The megatron trainer the sync workers push from: an HF model's weights in megatron-core
chunks at a given layout, and in-place perturbations of them (as an optimizer step)."""

from __future__ import annotations

from typing import Any

import torch


def hf_trainer_chunks(
    model_dir: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    vpp: int | None = None,
    first_stage_layers: int | None = None,
) -> list[Any]:
    """Start this rank (process groups, seeds) and build the model chunks of the HF model
    at ``model_dir`` with its weights (local spec, 32-token sequences); ``first_stage_layers``:
    megatron-core's uneven pipeline split."""
    from titan_core.config.pretrain import PretrainConfig
    from titan_core.models.gpt import (
        build_model_chunks,
        build_transformer_config,
        padded_vocab_size,
    )
    from titan_core.models.hf import HFBridge, model_config_from_hf
    from titan_core.parallel.initialize import initialize

    model = model_config_from_hf(model_dir, seq_length=32, transformer_impl="local")
    cfg = PretrainConfig.model_validate(
        {
            "model": model.model_dump(),
            "parallel": {
                "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": pp,
                "expert_model_parallel_size": ep,
                "virtual_pipeline_model_parallel_size": vpp,
                "num_layers_in_first_pipeline_stage": first_stage_layers,
            },
            "train": {"micro_batch_size": 1, "global_batch_size": 8, "lr_warmup_iters": 0},
        }
    )
    accel, _, _ = initialize(cfg)
    tf = build_transformer_config(cfg, accel)
    chunks = build_model_chunks(cfg, tf, padded_vocab_size(model.vocab_size, cfg), accel)
    HFBridge(model_dir).load(chunks, model_dir)
    return chunks


def perturb(chunks: list[Any], seed: int) -> None:
    """Add seeded noise to every parameter in place: weights no engine has seen yet."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.dtype))
