"""Save and load with megatron-core ``dist_checkpointing``.

Layout on disk (Megatron-LM's):  ``<dir>/iter_0000050/`` (one dist checkpoint) and
``<dir>/latest_checkpointed_iteration.txt``. The tracker file is written last, atomically,
after every rank has finished writing, so a process killed during a save never leaves a
checkpoint that resume would pick up. Tensors are saved as ``ShardedTensor`` with their
global shape and offset, so a checkpoint saved at TP=2 loads at TP=1 (or any PP/VPP/EP).
``common.pt`` holds what Megatron-LM's loader reads at its top level (``args``,
``iteration``, ``checkpoint_version``, ...: :mod:`titan_core.checkpoint.megatron_lm`) and
Titan's own state under ``common``. A tracker holding ``release`` names the folder
``<dir>/release/`` (Megatron-LM's release checkpoint, e.g. slime's converted HF model):
weights to start from, never a resume point (:data:`RELEASE`).
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_core.accelerator import megatron_scope
from titan_core.checkpoint import megatron_lm
from titan_core.checkpoint.verify import CheckpointError, damage, describe

TRACKER = "latest_checkpointed_iteration.txt"

#: the iteration :func:`latest_iteration` answers for a tracker holding ``release``
#: (Megatron-LM's ``read_metadata``), whose folder is ``release/``: Megatron-LM loads it as
#: iteration 0 with no optimizer, scheduler or RNG state, and so does Titan (weights only)
RELEASE = -1


def iteration_dir(root: str | Path, iteration: int) -> Path:
    """The folder of ``iteration`` under ``root`` (``release/`` for :data:`RELEASE`)."""
    if iteration == RELEASE:
        return Path(root) / "release"
    return Path(root) / f"iter_{iteration:07d}"


def iteration_name(iteration: int) -> str:
    """``iteration N``, or ``the release checkpoint``, for messages."""
    return "the release checkpoint" if iteration == RELEASE else f"iteration {iteration}"


def _iterations(root: Path) -> list[int]:
    return sorted(
        int(p.name[5:]) for p in root.glob("iter_*") if p.name[5:].isdigit() and p.is_dir()
    )


def latest_iteration(root: str | Path | None) -> int | None:
    """The newest complete, readable checkpoint's iteration under ``root``, or None;
    :data:`RELEASE` where the tracker holds ``release`` (Megatron-LM's convention).

    The tracker file names the newest complete save. If that iteration is damaged (a shard
    truncated, a file missing or unreadable: see ``verify.damage``), the newest older
    iteration that passes the same checks is used instead, with a warning naming the
    damaged one and why: a preempted job restarted unattended goes on from its last good
    save. If none passes, :class:`CheckpointError` names each problem. A release checkpoint
    has nothing older to fall back on. A tracker that holds neither an iteration number nor
    ``release`` is refused.
    """
    if root is None:
        return None
    root = Path(root)
    tracker = root / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if text == "release":
        candidates = [RELEASE]
    elif text.isdigit():
        newest = int(text)
        candidates = [newest, *reversed([i for i in _iterations(root) if i < newest])]
    else:
        raise CheckpointError(
            f"{tracker} should hold an iteration number (or 'release'), not {text[:80]!r}; "
            f"write the newest complete iteration's number into it or remove the folder {root}"
        )
    problems = []
    for iteration in candidates:
        why = damage(iteration_dir(root, iteration))
        if why is None:
            if problems:
                _warn(
                    f"checkpoint {root}: using iteration {iteration}, the newest that can be "
                    f"loaded; skipped {'; '.join(problems)}"
                )
            return iteration
        problems.append(f"{iteration_name(iteration)}: {why}")
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


def _model_state(model: list, metadata: dict[str, Any]) -> dict[str, Any]:
    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict(metadata=dict(metadata))}
    return {
        f"model{i}": unwrap(chunk).sharded_state_dict(metadata=dict(metadata))
        for i, chunk in enumerate(model)
    }


def _full_state(
    model: list, optimizer: Any, is_loading: bool, metadata: dict[str, Any]
) -> dict[str, Any]:
    """The sharded state dict, built with the content ``metadata`` (Megatron-LM's: how the
    state is sharded; a load uses the checkpoint's own)."""
    state = _model_state(model, metadata)
    if optimizer is not None:
        # The nested dict as is: chunks share local key names, their sharded keys differ.
        # fully_reshardable: the distributed optimizer's state is saved per parameter (the
        # default flattened layout is not loadable by the torch_dist strategy in 0.16).
        state["optimizer"] = optimizer.sharded_state_dict(
            dict(state), is_loading=is_loading, metadata=dict(metadata)
        )
    return state


def _in_process_write_results() -> None:
    """Give megatron's checkpoint writer an in-process queue for its write results.

    ``FileSystemWriterAsync`` hands the files' write results to the saving process through a
    queue it makes once per process: a spawn-context ``multiprocessing.Manager``'s, so that
    an async save's persistent worker process can reach it. That Manager is a fresh
    interpreter which imports torch to unpickle the results (each process's first save
    waits 1-3 s for it, more on a busy machine) and is joined at exit (~1 s). Titan saves
    synchronously (``AsyncRequest.execute_sync``): the results are put and read in this
    process, so a thread-safe in-process queue carries them, and an error raised while
    writing arrives as the exception object itself."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


@megatron_scope()
def save_checkpoint(
    root: str | Path,
    iteration: int,
    model: list,
    optimizer: Any,
    common: dict[str, Any],
    keep_last: int = 0,
    retain_interval: int | None = None,
) -> Path:
    """Save model (+ optimizer) shards and ``common`` (step, scheduler, data position) as
    Megatron-LM lays a ``torch_dist`` checkpoint out (its common keys beside Titan's
    ``common``; the scheduler as its ``opt_param_scheduler``). ``keep_last``: older
    iterations beyond the newest N are removed (0: none). ``retain_interval`` (Megatron-LM's
    ``--save-retain-interval``): the checkpoint the tracker named before this save is
    removed unless its iteration is a multiple of it (see :func:`_drop_unretained`)."""
    # torch.distributed.checkpoint is heavy (DTensor, sympy): imported by saves, not by the
    # processes that only read this package's helpers (the driver, the engines)
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    path = iteration_dir(root, iteration)
    if _rank() == 0:
        if path.exists():  # a save of this iteration that never completed
            shutil.rmtree(path)
        path.mkdir(parents=True)
    _barrier()
    metadata = dict(megatron_lm.CONTENT_METADATA)
    state = _full_state(model, optimizer, is_loading=False, metadata=metadata)
    chunk = unwrap(model[0]) if model else None
    # a release checkpoint (converted weights) is iteration 0 to Megatron-LM
    state.update(megatron_lm.common_state(max(iteration, 0), chunk, optimizer, common))
    state["common"] = {k: v for k, v in common.items() if k != "scheduler"}
    _in_process_write_results()
    try:
        dist_checkpointing.save(state, str(path), content_metadata=metadata)
    except (Exception, CheckpointException) as e:  # torch's is a BaseException
        what = _disk_failure(e, path)
        if what is None:
            raise
        # the partial folder would hold the space a retry needs, and is never loaded
        shutil.rmtree(path, ignore_errors=True)
        raise CheckpointError(
            f"saving iteration {iteration} to {path} failed: {what}; the partial folder was "
            f"removed, the previous checkpoint under {root} is intact. Free space there (or "
            "set checkpoint.keep_last lower, or checkpoint.save elsewhere) and resume"
        ) from e
    _barrier()
    if _rank() == 0:
        previous = _tracked_iteration(Path(root))
        tmp = Path(root) / f".{TRACKER}.tmp"
        tmp.write_text("release" if iteration == RELEASE else str(iteration))
        os.replace(tmp, Path(root) / TRACKER)
        if keep_last:
            _prune(Path(root), keep_last, iteration)
        if retain_interval:
            _drop_unretained(Path(root), previous, iteration, retain_interval)
    _barrier()
    return path


def _tracked_iteration(root: Path) -> int | None:
    """The iteration number the tracker holds (None: no tracker, ``release``, or not a
    number)."""
    try:
        text = (root / TRACKER).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _drop_unretained(root: Path, previous: int | None, current: int, interval: int) -> None:
    """Megatron-LM's ``--save-retain-interval`` (``save_checkpoint``'s finalize step): once
    the tracker names ``current``, the iteration it named before is removed if it is
    positive, not ``current`` and not a multiple of ``interval`` (a symbolic link is left).
    What stays: the iterations at multiples of ``interval``, and the newest."""
    if previous is None or previous <= 0 or previous == current or previous % interval == 0:
        return
    folder = iteration_dir(root, previous)
    if not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)


#: free bytes below which a file system that failed a save counts as full
FULL_BELOW_BYTES = 16 << 20


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind ``e``: dist_checkpointing wraps the writers' errors, and torch's
    CheckpointException carries each rank's in ``failures``."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        for exc, _trace in getattr(e, "failures", {}).values():
            if (found := _os_error(exc)) is not None:
                return found
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _disk_failure(e: BaseException, path: Path) -> str | None:
    """What the disk did to a failed save, in words; None: not the disk.

    A full file system does not always come back as ENOSPC: torch's shard writer reports a
    short write as ``[enforce fail at inline_container.cc] unexpected pos ...``. So a save
    that failed while the file system holding it has (almost) nothing free counts as full."""
    os_error = _os_error(e)
    if os_error is not None and os_error.errno != errno.ENOSPC:
        return str(os_error)
    if os_error is not None:
        return "no space left on the device"
    try:
        free = shutil.disk_usage(path if path.exists() else path.parent).free
    except OSError:
        return None
    if free < FULL_BELOW_BYTES:
        return (
            f"no space left on the device ({free} bytes free after the writer failed: {_said(e)})"
        )
    return None


def _said(e: BaseException) -> str:
    """``e`` in one line (a CheckpointException: its first rank's error)."""
    failures = getattr(e, "failures", {})
    if failures:
        e = next(iter(failures.values()))[0]
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


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
    """Load shards into ``model`` (and ``optimizer`` if given); return Titan's common state
    (with the scheduler state, Megatron-LM's ``opt_param_scheduler``, as ``scheduler``).
    The state is built with the checkpoint's content metadata, as Megatron-LM's loader
    does (Titan's earlier checkpoints, without one: the sharding they were saved with)."""
    from megatron.core import dist_checkpointing

    path = iteration_dir(root, iteration)
    if optimizer is not None:
        allocate_optimizer_state(optimizer)
    try:
        saved = dist_checkpointing.load_content_metadata(str(path))
    except Exception as e:
        raise _unloadable(root, iteration, e) from None
    metadata = dict(saved or megatron_lm.LEGACY_CONTENT_METADATA)
    state = _full_state(model, optimizer, is_loading=True, metadata=metadata)
    state["common"] = {}
    try:
        loaded = dist_checkpointing.load(state, str(path))
    except Exception as e:  # damage the cheap checks before the load could not see
        raise _unloadable(root, iteration, e) from None
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        load_optimizer_state(optimizer, loaded["optimizer"])
    common = dict(loaded.get("common") or {})
    if "scheduler" not in common and loaded.get("opt_param_scheduler") is not None:
        common["scheduler"] = loaded["opt_param_scheduler"]
    return common


def _unloadable(root: str | Path, iteration: int, e: BaseException) -> CheckpointError:
    path = iteration_dir(root, iteration)
    return CheckpointError(
        f"could not load {iteration_name(iteration)} from {path}: {_load_error(e)}. If the "
        f"files are damaged, restore them, or move {path.name} aside and update "
        f"{Path(root) / TRACKER} to the previous iteration"
    )


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
