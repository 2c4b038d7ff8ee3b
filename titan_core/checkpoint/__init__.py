"""Checkpoints with megatron-core ``dist_checkpointing`` (reshardable across layouts), in
Megatron-LM's layout (:mod:`titan_core.checkpoint.megatron_lm`).

Importing this package registers, once, the classes a Titan ``common.pt`` holds beyond
plain data (Megatron-LM's ``args`` Namespace) with ``torch.serialization.add_safe_globals``,
so ``torch.load``'s default ``weights_only=True`` (megatron-core's ``load_common``, Titan's
checks) reads them: every Titan save and load goes through this package.
"""

from titan_core.checkpoint.dist import (
    RELEASE,
    CheckpointWarning,
    latest_iteration,
    load_checkpoint,
    save_checkpoint,
    saved_vocab_rows,
)
from titan_core.checkpoint.megatron_lm import register_safe_globals
from titan_core.checkpoint.verify import CheckpointError, damage

__all__ = [
    "RELEASE",
    "CheckpointError",
    "CheckpointWarning",
    "damage",
    "latest_iteration",
    "load_checkpoint",
    "register_safe_globals",
    "save_checkpoint",
    "saved_vocab_rows",
]

register_safe_globals()
