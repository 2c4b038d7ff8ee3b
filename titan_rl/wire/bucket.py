"""Flattened buckets: tensors' bytes back to back in one uint8 buffer, with SGLang's
``FlattenedTensorMetadata`` telling where each one lies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from titan_rl.wire.errors import RequestError

NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened uint8 bucket (SGLang's field names)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def metadata_class() -> type:
    """SGLang's metadata type when SGLang is installed (its unpickler expects it), else ours."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata as theirs
    except ImportError:
        return FlattenedTensorMetadata
    return theirs


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


def flatten_named_tensors(named: NamedTensors) -> tuple[torch.Tensor, list[Any]]:
    """``named`` in a new uint8 buffer (:func:`flatten_into` without a buffer to reuse)."""
    if not named:
        raise ValueError("cannot flatten an empty list of tensors")
    buf = torch.empty(bucket_nbytes(named), dtype=torch.uint8, device=named[0][1].device)
    return flatten_into(buf, named)


def unflatten(flat: torch.Tensor, metadata: list[Any]) -> NamedTensors:
    """Views of ``flat`` per metadata entry; entries may be objects, dicts or lists."""
    out = []
    for m in metadata:
        if isinstance(m, dict):
            name, shape, dtype = m["name"], m["shape"], m["dtype"]
            start, end = m["start_idx"], m["end_idx"]
        elif isinstance(m, list | tuple):
            name, shape, dtype, start, end = m[0], m[1], m[2], m[3], m[4]
        else:
            name, shape, dtype, start, end = m.name, m.shape, m.dtype, m.start_idx, m.end_idx
        dtype = parse_dtype(dtype)
        chunk = flat[start:end]
        if flat.dtype == torch.uint8 and dtype != torch.uint8:
            if chunk.storage_offset() % dtype.itemsize:
                chunk = chunk.clone()  # unaligned inside the bucket: copy before reinterpreting
            chunk = chunk.view(dtype)
        out.append((str(name), chunk.reshape(tuple(shape))))
    return out


_DTYPES = {
    dtype_str: d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    )
    for dtype_str in [str(d).removeprefix("torch.")]
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the name SGLang's APIs take)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(value: Any) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise RequestError(f"unknown dtype {value!r}; use one of {sorted(_DTYPES)}")
