"""Weight-update transports of the built-in engine, on SGLang's wire formats.

- disk: an HF safetensors directory (``*.safetensors``, optionally sharded).
- tensor: base64 ForkingPickler dumps of ``[(name, tensor)]`` or of a flattened bucket
  ``{"flattened_tensor": uint8, "metadata": [FlattenedTensorMetadata]}``. CPU tensors travel
  through torch shared memory (the sender must use ``file_system`` sharing). The payload is
  read by :class:`RestrictedUnpickler`, which admits only tensor/storage rebuilds, torch dtypes
  and sizes, and the bucket metadata type: a request can never run arbitrary code.
- distributed: a standalone process group (gloo on CPU) the trainer joins as rank 0; each
  named tensor (or one flattened uint8 buffer) is received with ``broadcast(src=0)``.
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_rl.engine.sampling import RequestError

log = logging.getLogger("titan_rl.engine.weights")


@dataclass
class FlattenedTensorMetadata:
    """One tensor's place in a flattened uint8 bucket (SGLang's field names)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


def flatten_named_tensors(
    named: list[tuple[str, torch.Tensor]],
) -> tuple[torch.Tensor, list[FlattenedTensorMetadata]]:
    """Concatenate tensors' bytes into one uint8 buffer, SGLang's ``FlattenedTensorBucket`` layout."""
    parts, meta, offset = [], [], 0
    for name, t in named:
        raw = t.detach().contiguous().flatten().view(torch.uint8)
        meta.append(
            FlattenedTensorMetadata(
                name, t.shape, t.dtype, offset, offset + raw.numel(), raw.numel()
            )
        )
        parts.append(raw)
        offset += raw.numel()
    if not parts:
        raise ValueError("cannot flatten an empty list of tensors")
    return torch.cat(parts), meta


def unflatten(flat: torch.Tensor, metadata: list[Any]) -> list[tuple[str, torch.Tensor]]:
    """Inverse of :func:`flatten_named_tensors`; metadata entries may be objects, dicts or lists."""
    out = []
    for m in metadata:
        if isinstance(m, dict):
            name, shape, dtype, start, end = (
                m["name"],
                m["shape"],
                m["dtype"],
                m["start_idx"],
                m["end_idx"],
            )
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
    str(d).removeprefix("torch."): d
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
    )
}


def parse_dtype(value: Any) -> torch.dtype:
    """A torch dtype from a dtype or its name ("bfloat16", "torch.bfloat16")."""
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in _DTYPES:
        return _DTYPES[value.removeprefix("torch.")]
    raise RequestError(f"unknown dtype {value!r}; use one of {sorted(_DTYPES)}")


# ---- restricted unpickling ------------------------------------------------------------

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
_BUCKET_TYPES = {
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
    ("titan_rl.engine.weights", "FlattenedTensorMetadata"),
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


def decode_tensor_payload(b64: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
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


# ---- disk ---------------------------------------------------------------------------------


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (or a single file).

    Every failure (missing, unreadable, no ``*.safetensors``, corrupt) answers the same
    message, so a client cannot probe which paths exist on the host; the reason is logged.
    """
    from safetensors.torch import load_file

    try:
        p = Path(path)
        files: list[Path] = []
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(p.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError("not a safetensors file or a directory holding some")
        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    except Exception as e:
        log.warning(
            "update_weights_from_disk: cannot load %r: %s: %s", str(path), type(e).__name__, e
        )
        raise RequestError(
            f"cannot load weights from {str(path)!r}: model_path must name a readable "
            "safetensors checkpoint (a *.safetensors file or a directory of them, saved with "
            "safe_serialization=True) on the engine's host; the engine's log has the reason"
        ) from None


# ---- distributed --------------------------------------------------------------------------


def join_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Join the trainer's weight-update group (not the default one) for broadcasts.

    Both the trainer (rank 0, which hosts the store) and every engine rank call this with the
    same address, port, world size and group name; the rendezvous is SGLang's
    (:mod:`titan_rl.sync.process_group`).
    """
    if backend != "gloo":
        raise RequestError(
            f"backend {backend!r} is not available in the CPU engine; use backend='gloo' "
            "(titan_core.accelerator.get_accelerator().weight_update_backend() gives it)"
        )
    if not 0 <= rank < world_size:
        raise RequestError(f"rank {rank} is outside world_size {world_size}")
    from titan_rl.sync.process_group import init_weights_update_group

    return init_weights_update_group(
        master_address, master_port, rank, world_size, group_name, backend, timeout_s
    )


def receive_broadcast(
    pg: dist.ProcessGroup,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    load_format: str | None,
) -> list[tuple[str, torch.Tensor]]:
    """Receive tensors broadcast from rank 0, one by one or as one flattened uint8 bucket."""
    empties = [
        (n, torch.empty(tuple(s), dtype=parse_dtype(d)))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    ]
    if load_format == "flattened_bucket":
        nbytes = sum(t.numel() * t.element_size() for _, t in empties)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        pg.broadcast(flat, 0).wait()
        offset, out = 0, []
        for n, t in empties:
            size = t.numel() * t.element_size()
            out.append((n, unflatten(flat, [(n, t.shape, t.dtype, offset, offset + size)])[0][1]))
            offset += size
        return out
    for _, t in empties:
        pg.broadcast(t, 0).wait()
    return empties


def broadcast_named_tensors(
    pg: dist.ProcessGroup, named: list[tuple[str, torch.Tensor]], load_format: str | None = None
) -> None:
    """Trainer side (rank 0) of :func:`receive_broadcast`: send in the same order and layout."""
    if load_format == "flattened_bucket":
        flat, _ = flatten_named_tensors(named)
        pg.broadcast(flat, 0).wait()
        return
    for _, t in named:
        pg.broadcast(t.detach().contiguous(), 0).wait()


# ---- checkpoint names -> model tensors --------------------------------------------------

#: Fused expert tensors (transformers >= 5 stores MoE experts as 3-D parameters) and the
#: per-expert checkpoint names (as in HF safetensors and SGLang's update APIs) they hold.
_FUSED_EXPERTS = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def checkpoint_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The model's tensors under HF checkpoint names, as views sharing the model's storage.

    Returns ``(targets, fused)``: ``targets`` maps every name a checkpoint of this model holds
    to the tensor to copy it into (a per-expert name of a fused expert tensor maps to a view of
    its slice); ``fused`` maps each per-expert name to the fused tensor's own name, which is
    accepted too (as ``targets``' key) so updates in either naming work.
    """
    state = model.state_dict()
    targets: dict[str, torch.Tensor] = dict(state)
    fused: dict[str, str] = {}
    for prefix, module in model.named_modules():
        if not all(isinstance(getattr(module, p, None), torch.Tensor) for p in _FUSED_EXPERTS):
            continue
        gate_up, down = state.get(f"{prefix}.gate_up_proj"), state.get(f"{prefix}.down_proj")
        if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
            continue
        transposed = bool(getattr(module, "is_transposed", False))
        if not getattr(module, "has_gate", True):
            raise ValueError(f"{prefix}: fused experts without a gate are not mapped")
        # [E, 2I, H] (gate rows, then up rows) and [E, H, I]; transposed: [E, H, 2I], [E, I, H]
        gu = gate_up.transpose(1, 2) if transposed else gate_up
        dn = down.transpose(1, 2) if transposed else down
        inter = gu.shape[1] // 2
        gu_bias = state.get(f"{prefix}.gate_up_proj_bias")
        dn_bias = state.get(f"{prefix}.down_proj_bias")
        per_expert = {  # (HF suffix, fused suffix) -> one view per expert
            ("weight", ""): {
                "gate_proj": [w[:inter] for w in gu],
                "up_proj": [w[inter:] for w in gu],
                "down_proj": list(dn),
            },
            ("bias", "_bias"): {
                "gate_proj": [] if gu_bias is None else [b[:inter] for b in gu_bias],
                "up_proj": [] if gu_bias is None else [b[inter:] for b in gu_bias],
                "down_proj": [] if dn_bias is None else list(dn_bias),
            },
        }
        for (suffix, fused_suffix), views in per_expert.items():
            for whole, parts in _FUSED_EXPERTS.items():
                for part in parts:
                    for e, view in enumerate(views[part]):
                        name = f"{prefix}.{e}.{part}.{suffix}"
                        targets[name] = view
                        fused[name] = f"{prefix}.{whole}{fused_suffix}"
    return targets, fused
