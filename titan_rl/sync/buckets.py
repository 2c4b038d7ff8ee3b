"""Flattened buckets in SGLang's ``FlattenedTensorBucket`` layout, into a reusable buffer."""

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


def bucket_nbytes(named: NamedTensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in named)


def flatten_into(buf: torch.Tensor, named: NamedTensors) -> tuple[torch.Tensor, list[Any]]:
    """Copy ``named`` back to back into the uint8 ``buf``; return the used view and metadata."""
    meta_cls = metadata_class()
    meta, offset = [], 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if offset + n > buf.numel():
            raise ValueError(
                f"bucket of {bucket_nbytes(named)} bytes does not fit the {buf.numel()}-byte buffer"
            )
        dst = buf[offset : offset + n]
        if offset % t.element_size() == 0:  # strided sources (QKV slices) copy in one pass
            dst.view(t.dtype).view(t.shape).copy_(t.detach())
        else:
            dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
        meta.append(meta_cls(name, t.shape, t.dtype, offset, offset + n, t.numel()))
        offset += n
    return buf[:offset], meta


def dumps_bucket(flat: torch.Tensor, meta: list[Any]) -> str:
    """One ``serialized_named_tensors`` entry: CPU shared memory or CUDA/MUSA IPC handles."""
    if flat.device.type == "cpu" and not flat.is_shared():
        raise ValueError("CPU buckets must live in shared memory (allocate with share_memory_())")
    buf = io.BytesIO()
    ForkingPickler(buf).dump({"flattened_tensor": flat, "metadata": meta})
    return base64.b64encode(buf.getvalue()).decode("ascii")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
