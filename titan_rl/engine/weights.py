"""The built-in engine's side of the weight updates, beside the wire formats (titan_rl.wire).

- disk: an HF safetensors directory (``*.safetensors``, optionally sharded);
- tensor: ``serialized_named_tensors`` entries, read by :mod:`titan_rl.wire.payload`;
- distributed: a standalone process group (gloo on CPU) the trainer joins as rank 0; tensors
  arrive by ``broadcast(src=0)`` (:func:`titan_rl.wire.group.receive_broadcast`);
- checkpoint names -> the model's tensors (fused experts included);
- every update's tensors checked finite (:func:`check_finite`) before any is applied;
- where each TP rank gets an update's full tensors (:data:`Source`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

# re-exported: the engine's code reads the wire formats through this module
from titan_rl.wire.bucket import parse_dtype as parse_dtype
from titan_rl.wire.errors import RequestError
from titan_rl.wire.group import init_weights_update_group
from titan_rl.wire.group import receive_broadcast as receive_broadcast
from titan_rl.wire.payload import decode_tensor_payload as decode_tensor_payload

log = logging.getLogger("titan_rl.engine.weights")


# ---- what an update may hold ----------------------------------------------------------------

#: elements checked at a time (bounds the check's scratch memory on a large tensor)
_CHECK_CHUNK = 1 << 24


def _nonfinite(t: torch.Tensor) -> tuple[int, int]:
    """(NaN count, inf count) of a floating tensor, in chunks; dtypes without an ``isfinite``
    kernel (float8_e4m3fn on CPU) are read as float32."""
    flat = t.detach().reshape(-1)
    nan = inf = 0
    for start in range(0, flat.numel(), _CHECK_CHUNK):
        chunk = flat[start : start + _CHECK_CHUNK]
        try:
            finite = torch.isfinite(chunk)
        except (NotImplementedError, RuntimeError):
            chunk = chunk.float()
            finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            n_nan = int(torch.isnan(chunk).sum())
            nan += n_nan
            inf += int((~finite).sum()) - n_nan
    return nan, inf


def check_finite(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse an update holding NaN or inf (RequestError naming the parameters), before any
    of it is applied: an engine serving such weights answers NaN logprobs (``null`` in JSON)
    and token 0 for every request, silently. The trainer refuses to sync such weights
    (titan_core.training.finite); the engine holds other senders to the same rule."""
    bad: list[str] = []
    for name, t in named:
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        nan, inf = _nonfinite(t)
        if nan or inf:
            bad.append(f"{name!r} ({nan} NaN and {inf} inf of {t.numel()} values)")
    if bad:
        which = "parameter" if len(bad) == 1 else "parameters"
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise RequestError(
            f"non-finite weights (NaN or inf) refused, nothing was applied: {which} "
            f"{', '.join(bad[:3])}{more}"
        )


# ---- where each TP rank's tensors come from -------------------------------------------------


@dataclass(frozen=True)
class FromTensor:
    """``/update_weights_from_tensor``: ``payloads[k]`` is engine TP rank k's entry."""

    payloads: list[str]
    load_format: str | None

    def for_rank(self, rank: int) -> FromTensor:
        return FromTensor([self.payloads[rank]], self.load_format)


@dataclass(frozen=True)
class FromDisk:
    """``/update_weights_from_disk``: every rank reads the safetensors itself."""

    path: str

    def for_rank(self, rank: int) -> FromDisk:
        return self


@dataclass(frozen=True)
class FromGroup:
    """``/update_weights_from_distributed``: every rank receives the trainer's broadcast."""

    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    load_format: str | None

    def for_rank(self, rank: int) -> FromGroup:
        return self


#: where a weight update's full tensors come from on each TP rank
Source = FromTensor | FromDisk | FromGroup


# ---- disk ---------------------------------------------------------------------------------


def load_safetensors_dir(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint directory (or a single file).

    Every failure (missing, unreadable, no ``*.safetensors``, corrupt) answers the same
    message, so a client cannot probe which paths exist on the host; the reason is logged.
    """
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
    (:mod:`titan_rl.wire.group`).
    """
    if backend != "gloo":
        raise RequestError(
            f"backend {backend!r} is not available in the CPU engine; use backend='gloo' "
            "(titan_core.accelerator.get_accelerator().weight_update_backend() gives it)"
        )
    if not 0 <= rank < world_size:
        raise RequestError(f"rank {rank} is outside world_size {world_size}")
    return init_weights_update_group(
        master_address, master_port, rank, world_size, group_name, backend, timeout_s
    )


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
