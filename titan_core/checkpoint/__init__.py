"""Checkpoints with megatron-core ``dist_checkpointing`` (reshardable across layouts)."""

from titan_core.checkpoint.dist import (
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
    saved_vocab_rows,
)

__all__ = ["latest_iteration", "load_checkpoint", "save_checkpoint", "saved_vocab_rows"]
