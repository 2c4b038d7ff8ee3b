"""Non-finite guards: no NaN or inf reaches the weights, the rollout engines or the disk.

As Megatron-LM's ``check_for_nan_in_loss_and_grad`` (on by default), checked before the
optimizer step; megatron-core's optimizer only skips a step on the fp16 loss scaler's
found-inf: in fp32 and bf16 it applies a NaN gradient (a NaN grad norm is not clipped).
Every rank takes part in each check and the verdict is reduced over all ranks, so every rank
raises the same error rather than some waiting in a collective for the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """A loss, gradient or parameter is NaN or inf; nothing was applied, synced or saved."""


def _all_finite(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """One boolean tensor (no host sync per tensor)."""
    flags = [torch.isfinite(t).all() for t in tensors]
    if not flags:
        return torch.ones((), dtype=torch.bool, device=device)
    return torch.stack([f.to(device) for f in flags]).all()


def _grads(model: Sequence[torch.nn.Module]) -> list[torch.Tensor]:
    """The gradients of ``model``: megatron DDP's contiguous grad buffers (a few large
    tensors), else each parameter's ``main_grad`` or ``.grad``."""
    out = []
    for chunk in model:
        buffers = getattr(chunk, "buffers", None)
        if isinstance(buffers, list) and all(hasattr(b, "grad_data") for b in buffers):
            expert = getattr(chunk, "expert_parallel_buffers", [])
            out += [b.grad_data for b in buffers + expert]
            continue
        for p in chunk.parameters():
            g = getattr(p, "main_grad", None)
            g = p.grad if g is None else g
            if g is not None:
                out.append(g)
    return out


def _device(model: Sequence[torch.nn.Module]) -> torch.device:
    for chunk in model:
        for p in chunk.parameters():
            return p.device
    return torch.device("cpu")


def _max_over_ranks(values: torch.Tensor) -> list[float]:
    """``values`` maxed over every rank (as they are without torch.distributed)."""
    values = values.to(torch.float32)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def check_loss_and_grads(
    model: Sequence[torch.nn.Module],
    losses: Sequence[torch.Tensor],
    where: str,
    hint: str,
    check_grads: bool = True,
) -> None:
    """Raise NonFiniteError if a loss (this rank's microbatches; none off the last pipeline
    stage) or a gradient of ``model`` is NaN or inf on any rank. Call after the backward
    pass and before ``optimizer.step()``; ``check_grads=False`` under an fp16 loss scaler,
    whose found-inf already skips the step (an overflow there is routine)."""
    device = _device(model)
    loss_ok = _all_finite([torch.as_tensor(x).detach() for x in losses], device)
    grads_ok = _all_finite(_grads(model), device) if check_grads else loss_ok.new_ones(())
    bad_loss, bad_grads = _max_over_ranks(torch.stack([~loss_ok, ~grads_ok]))
    if bad_loss or bad_grads:
        what = " and ".join(w for w, b in (("loss", bad_loss), ("gradients", bad_grads)) if b)
        raise NonFiniteError(
            f"{where}: non-finite {what} (NaN or inf); the optimizer step was not applied "
            f"and the weights were neither synced nor saved. {hint}"
        )


def check_params(model: Sequence[torch.nn.Module], where: str, hint: str) -> None:
    """Raise NonFiniteError if a parameter of ``model`` is NaN or inf on any rank."""
    device = _device(model)
    params = [p.detach() for chunk in model for p in chunk.parameters()]
    (bad,) = _max_over_ranks(~_all_finite(params, device).reshape(1))
    if bad:
        raise NonFiniteError(f"{where}: the model has non-finite parameters (NaN or inf). {hint}")


def check_finite_values(
    values: torch.Tensor, where: str, hint: str, device: torch.device | None = None
) -> None:
    """Raise NonFiniteError if a row of ``values`` (say, one sample's reward) holds NaN or inf
    on any rank; ``device``: where the ranks' collective runs (the model's device)."""
    bad_rows = (~torch.isfinite(values.detach())).reshape(len(values), -1).any(-1)
    (bad,) = _max_over_ranks(bad_rows.sum().reshape(1).to(device or values.device))
    if bad:
        raise NonFiniteError(
            f"{where}: {int(bad)} of {len(values)} samples' values are NaN or inf. {hint}"
        )
