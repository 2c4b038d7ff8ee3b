"""Sender side of ``/update_weights_from_tensor``: SGLang's wire format for CPU tensors.

Each entry is a base64 ForkingPickler dump. CPU tensors are moved to torch shared memory and
pickled as shared-memory file names (the ``file_system`` sharing strategy), which any process
on the same host can open; the sender must keep the tensors alive until the call returns.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from titan_rl.wire.bucket import flatten_named_tensors
from titan_rl.wire.payload import dumps


def serialize_named_tensors(
    named: list[tuple[str, torch.Tensor]], load_format: str | None = None
) -> tuple[str, list[torch.Tensor]]:
    """One ``serialized_named_tensors`` entry and the shared tensors to keep alive meanwhile.

    ``load_format``: None/"direct" sends ``[(name, tensor)]``; "flattened_bucket" sends one
    uint8 buffer plus metadata (SGLang's FlattenedTensorBucket layout).
    """
    if any(t.device.type != "cpu" for _, t in named):
        raise ValueError(
            "serialize_named_tensors handles CPU tensors; GPU tensors travel as CUDA IPC"
        )
    mp.set_sharing_strategy("file_system")
    if load_format == "flattened_bucket":
        flat, meta = flatten_named_tensors(named)
        flat = flat.share_memory_()
        return dumps({"flattened_tensor": flat, "metadata": meta}), [flat]
    if load_format not in (None, "direct"):
        raise ValueError(f"load_format {load_format!r}: use None, 'direct' or 'flattened_bucket'")
    shared = [(n, t.detach().contiguous().clone().share_memory_()) for n, t in named]
    return dumps(shared), [t for _, t in shared]
