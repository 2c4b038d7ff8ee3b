"""The transports' reusable flattening buffer."""

from __future__ import annotations

import torch
import torch.multiprocessing

from titan_rl.sync import shm_reaper


class Staging:
    """A reusable flattening buffer (shared memory on CPU, device memory on GPU).

    It grows to the largest bucket seen (at most ``sync.bucket_bytes`` unless one tensor is
    larger), so a small model does not pin a full bucket of shared memory.
    """

    def __init__(self, device: torch.device, shared: bool = True) -> None:
        self.device, self.shared = device, shared and device.type == "cpu"
        self.buf: torch.Tensor | None = None

    def get(self, need: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < need:
            self.buf = None  # drop the old segment before mapping a larger one
            if self.shared:  # shared by file name: any local process can open it
                torch.multiprocessing.set_sharing_strategy("file_system")
            buf = torch.empty(need, dtype=torch.uint8, device=self.device)
            if self.shared:
                buf.share_memory_()
                shm_reaper.track(buf.untyped_storage())  # unlinked even after a kill -9
            self.buf = buf
        return self.buf

    def release(self) -> None:
        self.buf = None
