"""``serialized_named_tensors`` entries: base64 ForkingPickler dumps of ``[(name, tensor)]``
(``load_format="direct"``) or of a flattened bucket ``{"flattened_tensor", "metadata"}``.

CPU tensors travel as torch shared-memory file names (the sender uses the ``file_system``
sharing strategy), GPU tensors as CUDA/MUSA IPC handles. The receiver reads an entry with
:class:`RestrictedUnpickler`, which admits only tensor/storage rebuilds, torch dtypes and
sizes, and the bucket metadata type: a request can never run arbitrary code.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from titan_rl.wire.bucket import FlattenedTensorMetadata, NamedTensors, unflatten
from titan_rl.wire.errors import RequestError

# ---- sender ----------------------------------------------------------------------------------


def _check_shared(t: torch.Tensor) -> None:
    if t.device.type == "cpu" and not t.is_shared():
        raise ValueError("CPU buckets must live in shared memory (allocate with share_memory_())")


def dumps(obj: Any) -> str:
    """One entry: ``obj`` pickled with ForkingPickler (tensors by reference), base64."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def dumps_bucket(flat: torch.Tensor, meta: list[Any]) -> str:
    """One ``flattened_bucket`` entry: CPU shared memory or CUDA/MUSA IPC handles."""
    _check_shared(flat)
    return dumps({"flattened_tensor": flat, "metadata": meta})


def dumps_named(named: NamedTensors) -> str:
    """One ``load_format="direct"`` entry: ``[(name, tensor)]``, each tensor by reference.

    A tensor travels as its storage's shared-memory name (CPU) or IPC handle (GPU) plus offset,
    shape and strides, so a view of a larger storage (a parameter, a staging buffer) needs no
    copy. Pickling takes a transfer reference on each storage, which the receiver's unpickling
    drops: dump once per receiver (per engine TP rank) that loads it.
    """
    for _, t in named:
        _check_shared(t)
    return dumps([(n, t.detach()) for n, t in named])


# ---- receiver --------------------------------------------------------------------------------

_REBUILDS = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_storage_empty"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),
    ("builtins", "slice"),
}
#: the bucket metadata classes a sender may have pickled (SGLang's, Titan's old and new home)
_BUCKET_TYPES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("titan_rl.engine.weights", "FlattenedTensorMetadata"),
    ("titan_rl.wire.bucket", "FlattenedTensorMetadata"),
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles SGLang's tensor payloads and nothing else (no arbitrary callables)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _BUCKET_TYPES:
            return FlattenedTensorMetadata
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _REBUILDS:
            return super().find_class(module, name)
        if (module, name) == ("multiprocessing.resource_sharer", "DupFd"):
            raise RequestError(
                "tensors were shared by file descriptor, which only works between a parent and "
                "its child; call torch.multiprocessing.set_sharing_strategy('file_system') in the "
                "sender (titan_rl.rollout.serialize_named_tensors does this)"
            )
        if module.startswith("torch.multiprocessing") and "cuda" in name:
            raise RequestError(
                "CUDA IPC tensors cannot be loaded by the CPU engine; send CPU tensors"
            )
        raise RequestError(
            f"payload refers to {module}.{name}, which is not allowed in a tensor update"
        )


def loads_restricted(b64: str) -> Any:
    """Decode one ``serialized_named_tensors`` entry with :class:`RestrictedUnpickler`."""
    if not isinstance(b64, str):
        raise RequestError("serialized_named_tensors entries must be base64 strings")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("serialized_named_tensors entry is not valid base64") from None
    try:
        return RestrictedUnpickler(io.BytesIO(raw)).load()
    except RequestError:
        raise
    except Exception as e:  # truncated / corrupt pickles, missing shm segments
        raise RequestError(
            f"could not decode the tensor payload: {type(e).__name__}: {e}"
        ) from None


def decode_tensor_payload(b64: str, load_format: str | None) -> NamedTensors:
    """Named tensors from one ``serialized_named_tensors`` entry, validated."""
    obj = loads_restricted(b64)
    if load_format == "flattened_bucket" or isinstance(obj, dict):
        if not isinstance(obj, dict) or "flattened_tensor" not in obj or "metadata" not in obj:
            raise RequestError(
                "a flattened_bucket payload must be {'flattened_tensor', 'metadata'}"
            )
        flat = obj["flattened_tensor"]
        if not isinstance(flat, torch.Tensor):
            raise RequestError("flattened_tensor is not a tensor")
        return unflatten(flat, list(obj["metadata"]))
    if not isinstance(obj, list | tuple):
        raise RequestError("a tensor payload must be a list of (name, tensor) pairs")
    out = []
    for item in obj:
        if (
            not isinstance(item, list | tuple)
            or len(item) != 2
            or not isinstance(item[0], str)
            or not isinstance(item[1], torch.Tensor)
        ):
            raise RequestError("a tensor payload must be a list of (name, tensor) pairs")
        out.append((item[0], item[1]))
    return out
