"""torch_memory_saver (CUDA): pause a set of device allocations and resume them later.

torch_memory_saver releases the physical memory of the allocations made inside its
``region`` (keeping their virtual addresses, so every tensor stays valid) on ``pause`` and
maps fresh memory on ``resume``; with ``enable_cpu_backup`` the contents travel to host
memory and back. It works only through its ``LD_PRELOAD`` hook (slime's ``RayTrainGroup``
sets it on its trainer processes under ``--offload-train``), so it is used only where that
hook is loaded; elsewhere :func:`find_memory_saver` answers None and the caller frees
storages itself (``titan_core.training.device_memory``).

Two set-ups, both torch_memory_saver's own:

* whole process (``TMS_INIT_ENABLE=1``, slime's): every allocation since start-up is
  already in the default region, so ``region()`` must not be entered again (it refuses to
  nest) and ``pause()`` / ``resume()`` take every tag. Used only with
  ``TMS_INIT_ENABLE_CPU_BACKUP=1``: without a backup the contents would be thrown away.
* region: the caller allocates inside :meth:`MemorySaver.region` (one tag, CPU backup on)
  and pauses / resumes that tag.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from typing import Any


class MemorySaver:
    """One tag of torch_memory_saver (or the whole process), always with a host backup."""

    def __init__(self, tms: Any, tag: str, whole_process: bool) -> None:
        self.tms = tms
        self.tag = tag
        self.whole_process = whole_process

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        """Allocations made inside are the ones :meth:`pause` releases."""
        if self.whole_process:  # already inside torch_memory_saver's start-up region
            yield
            return
        with self.tms.region(tag=self.tag, enable_cpu_backup=True):
            yield

    def pause(self) -> None:
        self.tms.pause(None if self.whole_process else self.tag)

    def resume(self) -> None:
        self.tms.resume(None if self.whole_process else self.tag)


def find_memory_saver(tag: str) -> MemorySaver | None:
    """torch_memory_saver for ``tag`` where it is installed and its preload hook is loaded
    in this process; None otherwise (not installed, no hook, or a whole-process set-up
    without a CPU backup)."""
    if importlib.util.find_spec("torch_memory_saver") is None:
        return None
    if "torch_memory_saver" not in os.environ.get("LD_PRELOAD", ""):
        return None
    whole = os.environ.get("TMS_INIT_ENABLE") == "1"
    if whole and os.environ.get("TMS_INIT_ENABLE_CPU_BACKUP") != "1":
        return None
    from torch_memory_saver import torch_memory_saver

    return MemorySaver(torch_memory_saver, tag, whole)
