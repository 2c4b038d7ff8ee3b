"""``sync.transport: disk``: HF safetensors written atomically, then
``update_weights_from_disk``."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import torch
from pydantic import PositiveInt

from titan_rl.sync.transports.base import Engine, Failures, Transport, TransportSection, each_engine
from titan_rl.wire.bucket import NamedTensors


class DiskSync(TransportSection):
    """``sync.disk``: HF safetensors written atomically, then update_weights_from_disk."""

    #: where versions are written (one folder per version); required with this transport.
    dir: str | None = None
    #: keep this many newest versions on disk (>= 1: the restore point).
    keep: PositiveInt = 2

    def chosen_problem(self) -> str | None:
        if self.dir:
            return None
        return "sync.transport=disk needs sync.disk.dir: the folder the versions are written to"


class DiskTransport(Transport):
    """HF safetensors written to a hidden folder (each sender its own files), renamed into
    place, then loaded at commit. Senders on several hosts need ``sync.disk.dir`` on a shared
    filesystem."""

    name = "disk"
    settings_class = DiskSync
    summary = "HF safetensors written atomically, then update_weights_from_disk"
    incremental = False

    def __init__(self, settings: DiskSync, device: torch.device, timeout_s: float) -> None:
        super().__init__(settings, device, timeout_s)
        self.root = Path(settings.dir or ".")
        self.keep = settings.keep
        self._parts = 0
        self.path: Path | None = None

    def _incomplete(self, version: str) -> Path:
        return self.root / f".incomplete-{version}"

    async def prepare(self, engines: list[Engine], version: str) -> Failures:
        tmp = self._incomplete(version)
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return {}

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
        self._tmp = self._incomplete(version)
        self._parts = 0
        return {}

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        from safetensors.torch import save_file

        part = self._tmp / f"model-{self.sender.name}-{self._parts:05d}.safetensors"
        tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
        await asyncio.to_thread(save_file, tensors, str(part), {"format": "pt"})
        self._parts += 1
        return {}

    async def commit(self, engines: list[Engine], version: str) -> Failures:
        final = self.root / f"version-{version}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self._incomplete(version), final)  # atomic: a reader sees all or nothing
        self.path = final

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_disk(str(final), flush_cache=False)
            e.applied += 1

        failures = await each_engine(engines, one)
        self._prune(final)
        return failures

    def restore_path(self, version: str) -> str | None:
        return str(self.path) if self.path is not None else None

    def _prune(self, current: Path) -> None:
        versions = sorted(
            (p for p in self.root.glob("version-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for p in versions[: -self.keep]:
            if p != current:
                shutil.rmtree(p, ignore_errors=True)
