"""A trainer's device memory, counted, released and restored: what lets a trainer sleep
while a colocated rollout engine uses the device.

What a trainer holds on its device, by part (:func:`trainer_tensors`):

* ``weights``: the model chunks' parameters and buffers, and megatron DDP's contiguous
  parameter buffers (``_ParamAndGradBuffer.param_data``, where it has one; the parameters
  are views into it);
* ``grads``: DDP's contiguous gradient buffers (``grad_data``; every ``main_grad`` is a view
  into one) and any ``.grad``;
* ``optimizer``: the megatron optimizer's torch optimizer(s) (each of a chained optimizer):
  its parameters (fp32 main copies under bf16 / fp16 or the distributed optimizer, else the
  model's own), their ``.grad`` and the state (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``);
* ``ref``: the frozen reference model, where there is one.

Tensors are counted and moved per distinct storage (views share one), each counted once
under its first part in that order. :func:`device_storage_bytes` is the storage counter;
:class:`StorageOffload` copies every such storage to host memory (pinned on a GPU) and
frees it in place (``untyped_storage().resize_(0)``): every tensor object, view, parameter
and optimizer reference stays valid, and a restore (resize back, copy in) is bit-identical.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

#: the order parts are collected and restored in
PARTS = ("weights", "grads", "optimizer", "ref")


def _module_tensors(chunk: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Parameters and buffers of one model chunk, and megatron DDP's parameter buffers."""
    yield from chunk.parameters()
    # DDP's ``buffers`` attribute (its _ParamAndGradBuffers) hides nn.Module.buffers()
    yield from torch.nn.Module.buffers(chunk)
    for buf in _ddp_buffers(chunk):
        if buf.param_data is not None:
            yield buf.param_data


def _ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    """megatron DDP's ``_ParamAndGradBuffer``s of a chunk (dense and expert); none if the
    chunk is not DDP-wrapped."""
    dense = getattr(chunk, "buffers", None)
    experts = getattr(chunk, "expert_parallel_buffers", None)
    return [*(dense if isinstance(dense, list) else ()), *(experts or ())]


def _grad_tensors(chunk: torch.nn.Module) -> Iterator[torch.Tensor]:
    for buf in _ddp_buffers(chunk):
        if buf.grad_data is not None:
            yield buf.grad_data
    for p in chunk.parameters():
        for g in (getattr(p, "main_grad", None), p.grad):
            if isinstance(g, torch.Tensor):
                yield g


def _optimizer_tensors(optimizer: Any) -> Iterator[torch.Tensor]:
    """Main parameters, their grads and the state of a megatron optimizer (chained or not)."""
    for sub in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        inner = getattr(sub, "optimizer", None)
        if inner is None:  # a rank holding no parameters of this optimizer
            continue
        for group in inner.param_groups:
            for p in group["params"]:
                yield p
                if p.grad is not None:
                    yield p.grad
        for state in inner.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def trainer_tensors(
    model: Iterable[torch.nn.Module], optimizer: Any, ref_model: Iterable[torch.nn.Module] | None
) -> dict[str, list[torch.Tensor]]:
    """Every tensor the trainer keeps between steps, by part (module docstring)."""
    model = list(model)
    return {
        "weights": [t for c in model for t in _module_tensors(c)],
        "grads": [t for c in model for t in _grad_tensors(c)],
        "optimizer": list(_optimizer_tensors(optimizer)) if optimizer is not None else [],
        "ref": [t for c in (ref_model or ()) for t in _module_tensors(c)],
    }


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The tensor's storage; None for one that has none to move (a tensor subclass
    without a plain storage, a meta tensor)."""
    try:
        s = t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return None if s.device.type == "meta" else s


def distinct_storages(
    parts: dict[str, list[torch.Tensor]], device: torch.device
) -> dict[str, list[torch.UntypedStorage]]:
    """The non-empty storages on ``device`` of each part, each storage once (under its
    first part in :data:`PARTS` order)."""
    seen: set[int] = set()
    out: dict[str, list[torch.UntypedStorage]] = {}
    for part in [p for p in PARTS if p in parts] + [p for p in parts if p not in PARTS]:
        got = out.setdefault(part, [])
        for t in parts[part]:
            s = _storage(t)
            if s is None or s.nbytes() == 0 or not _on(s.device, device):
                continue
            if s.data_ptr() in seen:
                continue
            seen.add(s.data_ptr())
            got.append(s)
    return out


def _on(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index in (None, want.index))


def device_storage_bytes(parts: dict[str, list[torch.Tensor]], device: torch.device) -> int:
    """The storage counter: bytes of the distinct storages ``parts`` hold on ``device`` now
    (a storage freed in place counts 0)."""
    return sum(s.nbytes() for ss in distinct_storages(parts, device).values() for s in ss)


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (to copy it with tensor copies)."""
    n = storage.nbytes()
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (n,), (1,))


@dataclass
class _Held:
    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor
    resident: bool = False


class StorageOffload:
    """Moves a trainer's device storages to host memory and back, in place.

    ``accel``: the trainer's accelerator (host buffers, synchronize, empty_cache); ``device``:
    the device whose storages are moved.
    """

    def __init__(self, accel: Any, device: torch.device) -> None:
        self.accel = accel
        self.device = device
        self._held: dict[str, list[_Held]] = {}

    @property
    def asleep(self) -> bool:
        return bool(self._held)

    def offload(self, parts: dict[str, list[torch.Tensor]]) -> int:
        """Copy every distinct device storage of ``parts`` to host memory, then free it on
        the device; returns the bytes freed. A no-op (0) while already offloaded. A storage
        torch cannot resize (memory it does not own: numpy's, shared memory) stays, and
        stays counted."""
        if self._held:
            return 0
        held: dict[str, list[_Held]] = {}
        for part, storages in distinct_storages(parts, self.device).items():
            entries = []
            for s in filter(lambda s: s.resizable(), storages):
                host = self.accel.host_buffer(s.nbytes())
                host.copy_(_byte_view(s), non_blocking=True)
                entries.append(_Held(s, s.nbytes(), host))
            held[part] = entries
        self.accel.synchronize()  # every copy has landed before its source is freed
        for entries in held.values():
            for e in entries:
                e.storage.resize_(0)
        self._held = held
        self.accel.empty_cache()
        return sum(e.nbytes for es in held.values() for e in es)

    def restore(self) -> None:
        """Every storage back on the device with the bytes it had; host copies dropped."""
        for part in list(self._held):
            self._bring_back(part)
        self.accel.synchronize()
        self._held = {}

    @contextlib.contextmanager
    def resident(self, part: str) -> Iterator[None]:
        """``part`` back on the device inside the block, freed again after it (the host
        copy is kept, so what is done inside must not change ``part``: a weight sync
        reads the weights)."""
        if part not in self._held:
            yield
            return
        self._bring_back(part)
        self.accel.synchronize()
        try:
            yield
        finally:
            self.accel.synchronize()
            for e in self._held[part]:
                e.storage.resize_(0)
                e.resident = False
            self.accel.empty_cache()

    def _bring_back(self, part: str) -> None:
        for e in self._held[part]:
            if e.resident:
                continue
            e.storage.resize_(e.nbytes)
            _byte_view(e.storage).copy_(e.host, non_blocking=True)
            e.resident = True


class TrainerMemory:
    """Sleep and wake of one trainer's device memory.

    ``tensors`` gives the trainer's tensors by part (:func:`trainer_tensors`), asked anew at
    each sleep (the optimizer state appears at the first step). ``saver``: the
    accelerator's torch_memory_saver (``Accelerator.memory_saver``), which pauses what was
    allocated in :meth:`region`; None: :class:`StorageOffload` moves the storages.
    """

    def __init__(
        self, accel: Any, tensors: Any, saver: Any = None, device: torch.device | None = None
    ) -> None:
        self.accel = accel
        self.tensors = tensors
        self.saver = saver
        self.device = device if device is not None else accel.device()
        self.offload = StorageOffload(accel, self.device)
        self._paused = False

    @property
    def asleep(self) -> bool:
        return self._paused or self.offload.asleep

    def region(self) -> contextlib.AbstractContextManager:
        """Where the trainer allocates what a sleep must release (torch_memory_saver's
        region; nothing to enter without it)."""
        return self.saver.region() if self.saver is not None else contextlib.nullcontext()

    def device_bytes(self) -> int:
        """The storage counter over the trainer's model(s), grads and optimizer state."""
        return device_storage_bytes(self.tensors(), self.device)

    def sleep(self) -> dict[str, float]:
        """Release the trainer's device memory; its figures (nothing while asleep).

        ``memory/device_bytes_after_sleep``: the storage counter, or with torch_memory_saver
        (whose paused tensors keep their size) the counter less what the device got back.
        """
        if self.asleep:
            return {}
        import gc

        start = time.perf_counter()
        gc.collect()  # nothing stale (last step's activations) keeps memory alive
        before = self.device_bytes()
        if self.saver is not None:
            self.accel.synchronize()
            self.accel.empty_cache()
            free_before = self.accel.mem_get_info()[0]
            self.saver.pause()
            self._paused = True
            after = max(0, before - (self.accel.mem_get_info()[0] - free_before))
        else:
            self.offload.offload(self.tensors())
            after = self.device_bytes()
        return {
            "memory/device_bytes_before_sleep": float(before),
            "memory/device_bytes_after_sleep": float(after),
            "time/train_sleep": time.perf_counter() - start,
        }

    def wake_up(self) -> None:
        """Everything back on the device, as it was (nothing while awake)."""
        if self._paused:
            self.saver.resume()
            self._paused = False
        elif self.offload.asleep:
            self.offload.restore()

    @contextlib.contextmanager
    def weights_resident(self) -> Iterator[None]:
        """The weights on the device inside the block (asleep or not), for reading only;
        a sleeping trainer sleeps again after it. torch_memory_saver pauses one region
        as a whole, so there everything comes back for the block."""
        if self._paused:
            self.wake_up()
            try:
                yield
            finally:
                self.sleep()
            return
        with self.offload.resident("weights"):
            yield
