"""Tensor-transport payloads: flattened buckets in SGLang's ``FlattenedTensorBucket`` layout
(copied into a reusable buffer) and direct ``[(name, tensor)]`` lists (sent by reference)."""

from __future__ import annotations

import base64
import io
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

NamedTensors = list[tuple[str, torch.Tensor]]


def metadata_class() -> type:
    """SGLang's metadata type when SGLang is installed (its unpickler expects it), else ours."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        from titan_rl.engine.weights import FlattenedTensorMetadata
    return FlattenedTensorMetadata


def bucket_nbytes(named: NamedTensors, align: int = 1) -> int:
    """Bytes of ``named`` back to back, each tensor starting at a multiple of ``align``."""
    return sum(-(-t.numel() * t.element_size() // align) * align for _, t in named)


def flatten_into(
    buf: torch.Tensor, named: NamedTensors, align: int = 1
) -> tuple[torch.Tensor, list[Any]]:
    """Copy ``named`` back to back into the uint8 ``buf``; return the used view and metadata.

    ``align``: each tensor starts at a multiple of it (views of the buffer then never need a
    copy to be reinterpreted as their dtype).
    """
    meta_cls = metadata_class()
    meta, offset = [], 0
    for name, t in named:
        offset = -(-offset // align) * align
        n = t.numel() * t.element_size()
        if offset + n > buf.numel():
            raise ValueError(
                f"bucket of {bucket_nbytes(named, align)} bytes does not fit the "
                f"{buf.numel()}-byte buffer"
            )
        dst = buf[offset : offset + n]
        if offset % t.element_size() == 0:  # strided sources (QKV slices) copy in one pass
            dst.view(t.dtype).view(t.shape).copy_(t.detach())
        else:
            dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        meta.append(meta_cls(name, t.shape, t.dtype, offset, offset + n, t.numel()))
        offset += n
    return buf[:offset], meta


def _check_shared(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not t.is_shared():
        raise ValueError("CPU buckets must live in shared memory (allocate with share_memory_())")


def _dumps(obj: Any) -> str:
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def dumps_bucket(flat: torch.Tensor, meta: list[Any]) -> str:
    """One ``serialized_named_tensors`` entry: CPU shared memory or CUDA/MUSA IPC handles."""
    _check_shared(flat)
    return _dumps({"flattened_tensor": flat, "metadata": meta})


def dumps_named(named: NamedTensors) -> str:
    """One ``load_format="direct"`` entry: ``[(name, tensor)]``, each tensor by reference.

    A tensor travels as its storage's shared-memory name (CPU) or IPC handle (GPU) plus offset,
    shape and strides, so a view of a larger storage (a parameter, a staging buffer) needs no
    copy. Pickling takes a transfer reference on each storage, which the engine's unpickling
    drops: dump once per engine that loads it.
    """
    for _, t in named:
        _check_shared(t)
    return _dumps([(n, t.detach()) for n, t in named])


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
