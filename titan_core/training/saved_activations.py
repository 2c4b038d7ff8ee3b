"""Bytes of activations saved for backward: resident on the device vs moved out by offloading.

:class:`SavedActivationCounter` measures what ``train.offload_modules`` controls. Inside it,

* every tensor autograd saves for backward *outside* megatron-core's offload contexts goes
  through this module's ``saved_tensors_hooks``: the hook keeps the tensor (as autograd would)
  in a small holder that is counted until autograd frees it (after that node's backward);
* tensors saved *inside* an offload context go to megatron-core's own hooks (the innermost
  hooks win), into ``PipelineOffloadManager``'s chunk handlers: each layer group holds a
  saved tensor either as the tensor itself (not offloaded yet, too small, a group megatron
  keeps on the device, or reloaded for backward) or, once offloaded, as the state
  ``(device, cpu_backup, use_pool)``. The counter reads those groups (megatron-core
  0.16.1's ``PipelineOffloadManager._cached_chunks_forward[*].offload_groups[*]._tensors``).

Definitions (per process, i.e. per pipeline rank):

* **resident** bytes: the storages (each counted once, at its current size) of all saved
  tensors autograd or megatron's groups still hold as tensors, parameters excluded. On a GPU
  this is the activation memory that stays on the device; on CPU megatron's "offload" is a
  same-device copy (``cpu_backup.copy_(tensor)`` into its host pool; Titan's CPU compat
  makes ``pin_memory`` and the d2h/h2d streams inert), so the original storage is released
  exactly as on a GPU, once nothing else references it: what is counted is what a device
  would hold.
* **offloaded** bytes: the ``cpu_backup`` copies megatron's groups hold (host memory on a GPU).

Not counted: the pipeline schedule's own input/output tensors (held by the schedule, not
saved by autograd), gradients, parameters and optimizer state. Peaks are sampled at every
save, every retrieval in backward and every release, so they are exact at those moments.
On a GPU, ``torch.cuda.max_memory_allocated`` gives the allocator's view beside this.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (t.device.type, t.untyped_storage().data_ptr())


class _Held:
    """A saved tensor as the pack hook keeps it; its release (autograd dropping the node's
    saved state) is counted."""

    __slots__ = ("tensor", "counter", "key", "__weakref__")

    def __init__(self, tensor: torch.Tensor, counter: SavedActivationCounter) -> None:
        self.tensor = tensor
        self.counter = counter
        self.key = _storage_key(tensor)
        counter._hold(self.key, tensor)

    def __del__(self) -> None:
        self.counter._release(self.key)


def _megatron_groups() -> list[Any]:
    """megatron-core's offload groups of this process, if its manager exists (never creates it)."""
    try:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            PipelineOffloadManager,
        )
    except ImportError:
        return []
    mgr = PipelineOffloadManager.OFFLOAD_MGR
    if mgr is None:
        return []
    return [g for chunk in mgr._cached_chunks_forward for g in chunk.offload_groups]


class SavedActivationCounter:
    """Context manager counting saved-for-backward bytes; see the module docstring.

    ``exclude``: tensors (model parameters) whose storages are never counted.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {_storage_key(t) for t in exclude}
        #: storage key -> [storage, number of holders]
        self._held: dict[tuple[str, int], list[Any]] = {}
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)
        self._sampling = False
        self.resident_bytes = 0
        self.offloaded_bytes = 0
        self.peak_resident_bytes = 0
        self.peak_offloaded_bytes = 0

    def __enter__(self) -> SavedActivationCounter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        self.sample()

    def reset_peaks(self) -> None:
        """Start a new peak window (e.g. per step) from the current state."""
        self.sample()
        self.peak_resident_bytes = self.resident_bytes
        self.peak_offloaded_bytes = self.offloaded_bytes

    # ---- hooks ------------------------------------------------------------------------
    def _pack(self, tensor: torch.Tensor) -> Any:
        if _storage_key(tensor) in self._exclude:
            return tensor
        held = _Held(tensor, self)
        self.sample()
        return held

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, _Held):
            self.sample()
            return packed.tensor
        return packed

    def _hold(self, key: tuple[str, int], tensor: torch.Tensor) -> None:
        entry = self._held.get(key)
        if entry is None:
            self._held[key] = [tensor.untyped_storage(), 1]
        else:
            entry[1] += 1

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._held[key]
        self.sample()

    # ---- accounting -------------------------------------------------------------------
    def sample(self) -> None:
        """Recount resident and offloaded bytes now and update the peaks."""
        if self._sampling:  # a holder released by the garbage collector mid-sample
            return
        self._sampling = True
        try:
            self._sample()
        finally:
            self._sampling = False

    def _sample(self) -> None:
        storages = {key: entry[0] for key, entry in list(self._held.items())}
        offloaded = 0
        for group in _megatron_groups():
            for value in list(group._tensors.values()):
                if isinstance(value, torch.Tensor):
                    key = _storage_key(value)
                    if key not in self._exclude:
                        storages.setdefault(key, value.untyped_storage())
                elif isinstance(value, tuple) and len(value) == 3:  # (device, cpu_backup, pool)
                    offloaded += value[1].untyped_storage().nbytes()
        self.resident_bytes = sum(s.nbytes() for s in storages.values())
        self.offloaded_bytes = offloaded
        self.peak_resident_bytes = max(self.peak_resident_bytes, self.resident_bytes)
        self.peak_offloaded_bytes = max(self.peak_offloaded_bytes, self.offloaded_bytes)
