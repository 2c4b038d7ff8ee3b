"""Save and load with megatron-core ``dist_checkpointing``.

Layout on disk (Megatron's):  ``<dir>/iter_0000050/`` (one dist checkpoint) and
``<dir>/latest_checkpointed_iteration.txt``. The tracker file is written last, atomically,
after every rank has finished writing, so a process killed during a save never leaves a
checkpoint that resume would pick up. Tensors are saved as ``ShardedTensor`` with their
global shape and offset, so a checkpoint saved at TP=2 loads at TP=1 (or any PP/VPP/EP).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_core.accelerator import megatron_scope
from titan_core.checkpoint.verify import CheckpointError, damage, describe

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _iterations(root: Path) -> list[int]:
    return sorted(
        int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir()
    )


def latest_iteration(root: str | Path | None) -> int | None:
    """The newest complete, readable checkpoint's iteration under ``root``, or None.

    The tracker file names the newest complete save. If that iteration is damaged (a shard
    truncated, a file missing or unreadable: see ``verify.damage``), the newest older
    iteration that passes the same checks is used instead, with a warning naming the
    damaged one and why: a preempted job restarted unattended goes on from its last good
    save. If none passes, :class:`CheckpointError` names each problem. A tracker that does
    not hold an iteration number is refused.
    """
    if root is None:
        return None
    root = Path(root)
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(
            f"{tracker} should hold an iteration number, not {text[:80]!r}; write the newest "
            f"complete iteration's number into it or remove the folder {root}"
        )
    newest = int(text)
    problems = []
    for iteration in [newest, *reversed([i for i in _iterations(root) if i < newest])]:
        why = damage(iteration_dir(root, iteration))
        if why is None:
            if problems:
                _warn(
                    f"checkpoint {root}: using iteration {iteration}, the newest that can be "
                    f"loaded; skipped {'; '.join(problems)}"
                )
            return iteration
        problems.append(f"iteration {iteration}: {why}")
    raise CheckpointError(
        f"no loadable checkpoint under {root}: {'; '.join(problems)}. Restore the files, or "
        "remove the folder to start afresh"
    )


def _warn(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, CheckpointWarning, stacklevel=3)
        print(f"warning: {message}", file=sys.stderr, flush=True)


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped for an older one."""


#: the sharded keys whose first dimension is the (padded) vocabulary
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def saved_vocab_rows(root: str | Path, iteration: int) -> int | None:
    """The vocabulary rows (padding included) of the model saved at ``iteration``, read from
    the checkpoint's metadata (no tensor is loaded); None if it holds neither an embedding
    nor an output layer."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(iteration_dir(root, iteration)))
    for key in _VOCAB_KEYS:
        if key in meta:
            return int(meta[key].global_shape[0])
    return None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def unwrap(module: Any) -> Any:
    """The model inside DDP / Float16Module wrappers (their keys carry no ``module.``)."""
    while hasattr(module, "module"):
        module = module.module
    return module


def _model_state(model: list) -> dict[str, Any]:
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _full_state(model: list, optimizer: Any, is_loading: bool) -> dict[str, Any]:
    state = _model_state(model)
    if optimizer is not None:
        # The nested dict as is: chunks share local key names, their sharded keys differ.
        # fully_reshardable: the distributed optimizer's state is saved per parameter (the
        # default flattened layout is not loadable by the torch_dist strategy in 0.16).
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state),
            is_loading=is_loading,
            metadata={"distrib_optim_sharding_type": "fully_reshardable"},
        )
    return state


@megatron_scope()
def save_checkpoint(
    root: str | Path,
    iteration: int,
    model: list,
    optimizer: Any,
    common: dict[str, Any],
    keep_last: int = 0,
) -> Path:
    """Save model (+ optimizer) shards and ``common`` (step, scheduler, data position)."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    if _rank() == 0:
        if path.exists():  # a save of this iteration that never completed
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    state = _full_state(model, optimizer, is_loading=False)
    state["common"] = common
    try:
        dist_checkpointing.save(state, str(path))
    except Exception as e:
        os_error = _os_error(e)
        if os_error is None:
            raise
        # the partial folder would hold the space a retry needs, and is never loaded
        shutil.rmtree(path, ignore_errors=True)
        what = "no space left on the device" if os_error.errno == errno.ENOSPC else os_error
        raise CheckpointError(
            f"saving iteration {iteration} to {path} failed: {what}; the partial folder was "
            f"removed, the previous checkpoint under {root} is intact. Free space there (or "
            "set checkpoint.keep_last lower, or checkpoint.save elsewhere) and resume"
        ) from e
    _barrier()
    if _rank() == 0:
        tmp = Path(root) / f".{TRACKER}.tmp"
        tmp.write_text(str(iteration))
        os.replace(tmp, Path(root) / TRACKER)
        if keep_last:
            _prune(Path(root), keep_last, iteration)
    _barrier()
    return path


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e`` (dist_checkpointing wraps the writers' errors)."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _prune(root: Path, keep_last: int, current: int) -> None:
    complete = [i for i in _iterations(root) if i <= current]
    for i in complete[:-keep_last]:
        shutil.rmtree(iteration_dir(root, i), ignore_errors=True)


def allocate_optimizer_state(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped yet its Adam state.

    megatron-core 0.16's ``DistributedOptimizer.state_dict()`` (which building the state
    dict to load into calls) reads the ``step`` of every parameter's state in its inner
    optimizer. With TE or Apex it reads the param groups instead, but torch's Adam (no TE:
    CPU, MUSA) allocates its per-parameter state only at its first step, so a fresh one
    fails an assertion there. One step on zero gradients allocates it, as megatron-core
    does itself before its FSDP loads; the load then overwrites parameters and state.
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    if dopt.HAVE_APEX_OR_TE:
        return
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, dopt.DistributedOptimizer) or inner is None or len(inner.state):
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                if p.numel():
                    p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)


@megatron_scope()
def load_checkpoint(
    root: str | Path, iteration: int, model: list, optimizer: Any | None
) -> dict[str, Any]:
    """Load shards into ``model`` (and ``optimizer`` if given); return the common state."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    if optimizer is not None:
        allocate_optimizer_state(optimizer)
    state = _full_state(model, optimizer, is_loading=True)
    state["common"] = {}
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:  # damage the cheap checks before the load could not see
        raise CheckpointError(
            f"could not load iteration {iteration} from {path}: {_load_error(e)}. If the "
            f"files are damaged, restore them, or move {path.name} aside and update "
            f"{Path(root) / TRACKER} to the previous iteration"
        ) from None
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"])
    return loaded.get("common", {})


def _load_error(e: BaseException) -> str:
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    return describe(inner)


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """``optimizer.load_state_dict(state)``, with torch's Adam under the distributed optimizer.

    megatron-core 0.16's ``DistributedOptimizer.load_state_dict`` first puts the loaded
    ``step`` into every parameter's state of a torch Adam (no TE/Apex: CPU, MUSA), then
    copies the saved parameter state into exactly the keys that state has, ``step``
    included, which the saved parameter state leaves out on purpose: a KeyError. Here the
    parameter state is loaded in a second call, with ``step`` set aside meanwhile. And the
    one ``step`` tensor megatron-core shares between all parameters becomes one each (torch's
    Adam adds 1 to each parameter's ``step`` in place: a shared one would count each step
    once per parameter).
    """
    from megatron.core.optimizer import distrib_optimizer as dopt

    chained = getattr(optimizer, "chained_optimizers", None)
    if dopt.HAVE_APEX_OR_TE or chained is None:
        optimizer.load_state_dict(state)
        return
    if len(chained) == 1:
        parts = [state]
    else:
        parts = [v for _, v in sorted(state.items())] if isinstance(state, dict) else list(state)
    for opt, part in zip(chained, parts, strict=True):
        if not isinstance(opt, dopt.DistributedOptimizer) or "param_state" not in part:
            opt.load_state_dict(part)
            continue
        part = dict(part)
        param_state = part.pop("param_state")
        kind = part.pop("param_state_sharding_type")
        opt.load_state_dict(part)  # param groups, steps, grad scaler
        steps = {p: st.pop("step") for p, st in opt.optimizer.state.items() if "step" in st}
        try:
            getattr(opt, f"load_parameter_state_from_{_PARAM_STATE_LOADERS[kind]}")(param_state)
        finally:
            # one tensor per parameter: megatron-core hands every parameter the same one,
            # and torch's Adam increments each parameter's step in place
            for p, step in steps.items():
                opt.optimizer.state[p]["step"] = step.clone()


#: megatron-core's loader of each distributed-optimizer parameter-state format
_PARAM_STATE_LOADERS = {
    "fully_reshardable": "fully_reshardable",
    "dp_reshardable": "dp_reshardable",
    "fully_sharded_model_space": "fs_model_space",
    "dp_zero_gather_scatter": "dp_zero",
}
