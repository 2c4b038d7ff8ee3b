"""Checkpoints with megatron-core ``dist_checkpointing`` (reshardable across layouts)."""

from titan_core.checkpoint.dist import (
    CheckpointWarning,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
    saved_vocab_rows,
)
from titan_core.checkpoint.verify import CheckpointError, damage

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "damage",
    "latest_iteration",
    "load_checkpoint",
    "save_checkpoint",
    "saved_vocab_rows",
]
