"""The four ways buckets reach the engines. Each sends every bucket to every live engine and
reports failures per engine (it never raises for one engine's error), so the caller can keep
the trainer ranks' gathers going and leave failed engines on their old weights."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.multiprocessing

from titan_rl.rollout import SGLangClient
from titan_rl.sync.buckets import (
    NamedTensors,
    bucket_nbytes,
    dtype_name,
    dumps_bucket,
    flatten_into,
)
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.process_group import destroy_weights_update_group, init_weights_update_group

Failures = dict[str, BaseException]


@dataclass
class Engine:
    """One rollout engine as the sync sees it."""

    url: str
    client: SGLangClient
    index: int
    #: buckets this engine has applied in the current sync (0: still on the old weights).
    applied: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def _each(engines: list[Engine], fn: Any) -> Failures:
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    return {e.url: r for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)}


class Transport(ABC):
    #: True when one bucket per call is applied by the engine as it arrives (so a failure after
    #: the first bucket leaves it half-updated); False when the engine loads all at commit.
    incremental = True
    #: True when ``send`` of the next bucket may start before the previous one is applied
    #: (at most two in flight: the transport double-buffers its staging memory).
    pipelined = False

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        return {}

    @abstractmethod
    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures: ...

    async def commit(self, engines: list[Engine], version: str) -> Failures:
        return {}

    async def end(self, engines: list[Engine]) -> None:
        return None

    def close(self) -> None:
        return None


class _Staging:
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
            self.buf = buf.share_memory_() if self.shared else buf
        return self.buf

    def release(self) -> None:
        self.buf = None


class TensorTransport(Transport):
    """Colocated: one ``update_weights_from_tensor`` call per flattened bucket.

    Two staging buffers alternate, so bucket k+1 is flattened (in a worker thread) while the
    engines load bucket k. Flattening is one bucket at a time: two copies at once would only
    share the memory bandwidth and leave the engines idle until both are done. The buffers
    live for the whole run: engines that keep the last buckets' storages open map them once,
    not on every sync.
    """

    pipelined = True

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.staging = [_Staging(device), _Staging(device)]
        self._turn = 0
        self._flattening: asyncio.Lock | None = None

    def close(self) -> None:
        for s in self.staging:
            s.release()

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        # Every sync starts on the first buffer, so a model of one bucket reuses one mapping
        # (an engine maps a new segment page by page: ~3 ms per MiB under a sandboxed kernel).
        self._turn = 0
        self._flattening = asyncio.Lock()  # of this sync's event loop
        return {}

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        staging = self.staging[self._turn]
        self._turn ^= 1
        assert self._flattening is not None, "begin() opens every sync"
        async with self._flattening:
            flat, meta = await asyncio.to_thread(
                flatten_into, staging.get(bucket_nbytes(bucket)), bucket
            )
        if self.device.type != "cpu":
            torch.accelerator.synchronize()  # the copy must land before another process reads
        payload = dumps_bucket(flat, meta)

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_tensor(
                [payload], load_format="flattened_bucket", flush_cache=False
            )
            e.applied += 1

        return await _each(engines, one)


class DiskTransport(Transport):
    """HF safetensors written to a hidden folder, renamed into place, then loaded at commit."""

    incremental = False

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.root = Path(cfg.disk_dir or ".")
        self._tmp: Path | None = None
        self._parts = 0
        self.path: Path | None = None

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        self.root.mkdir(parents=True, exist_ok=True)
        self._tmp = self.root / f".incomplete-{version}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._parts = 0
        return {}

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        from safetensors.torch import save_file

        assert self._tmp is not None
        part = self._tmp / f"model-{self._parts:05d}.safetensors"
        tensors = {n: t.detach().cpu().contiguous() for n, t in bucket}
        await asyncio.to_thread(save_file, tensors, str(part), {"format": "pt"})
        self._parts += 1
        return {}

    async def commit(self, engines: list[Engine], version: str) -> Failures:
        assert self._tmp is not None
        final = self.root / f"version-{version}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(self._tmp, final)  # atomic: a reader sees the whole version or none
        self._tmp, self.path = None, final

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_disk(str(final), flush_cache=False)
            e.applied += 1

        failures = await _each(engines, one)
        self._prune(final)
        return failures

    def _prune(self, current: Path) -> None:
        versions = sorted(
            (p for p in self.root.glob("version-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for p in versions[: -self.cfg.disk_keep]:
            if p != current:
                shutil.rmtree(p, ignore_errors=True)


def _join_group(
    addr: str, port: int, rank: int, world: int, name: str, backend: str, timeout_s: float
) -> Any:
    """The trainer's side of ``init_weights_update_group`` (SGLang's rendezvous layout)."""
    if backend not in ("gloo", "nccl", "mccl"):
        raise ValueError(f"sync.backend {backend!r}: use gloo (CPU), nccl (CUDA) or mccl (MUSA)")
    return init_weights_update_group(addr, port, rank, world, name, backend, timeout_s)


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedTransport(Transport):
    """``init_weights_update_group`` once per engine, then a broadcast from the trainer."""

    def __init__(self, cfg: SyncConfig, device: torch.device, backend: str) -> None:
        super().__init__(cfg, device)
        self.backend = backend
        self.groups: dict[str, Any] = {}
        self.staging = _Staging(device, shared=False)

    def _name(self, e: Engine) -> str:
        return f"{self.cfg.group_name}-{e.index}"

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        async def one(e: Engine) -> None:
            if e.url in self.groups:
                return
            port = self.cfg.master_port + e.index if self.cfg.master_port else 0
            port = port or _free_port(self.cfg.master_address)
            args = (self.cfg.master_address, port, 0, 2, self._name(e), self.backend)
            join = asyncio.create_task(asyncio.to_thread(_join_group, *args, self.cfg.timeout_s))
            try:
                await e.client.init_weights_update_group(
                    self.cfg.master_address, port, 1, 2, self._name(e), self.backend
                )
            except BaseException:
                join.cancel()
                raise
            self.groups[e.url] = await join

        return await _each(engines, one)

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        flat, _ = flatten_into(self.staging.get(bucket_nbytes(bucket)), bucket)
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]

        async def one(e: Engine) -> None:
            pg = self.groups[e.url]
            req = asyncio.create_task(
                e.client.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=self._name(e),
                    load_format="flattened_bucket", flush_cache=False,
                )
            )  # fmt: skip
            await asyncio.to_thread(lambda: pg.broadcast(flat, 0).wait())
            await req
            e.applied += 1

        return await _each(engines, one)

    async def end(self, engines: list[Engine]) -> None:
        return None  # groups persist across syncs; destroyed in close()

    async def destroy(self, engines: list[Engine]) -> None:
        for e in engines:
            pg = self.groups.pop(e.url, None)
            if pg is not None:
                with contextlib.suppress(Exception):
                    await e.client.destroy_weights_update_group(self._name(e))
                destroy_weights_update_group(pg)


class MooncakeTransport(Transport):
    """Trainer writes each bucket into the agent's registered buffer, then the agent loads it."""

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        from mooncake.engine import TransferEngine

        self.te = TransferEngine()
        rc = self.te.initialize(
            cfg.mooncake_host, "P2PHANDSHAKE", cfg.mooncake_protocol, cfg.mooncake_device
        )
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({cfg.mooncake_host!r}, P2PHANDSHAKE, "
                f"{cfg.mooncake_protocol!r}) failed with {rc}; check sync.mooncake_host"
            )
        self.staging = _Staging(torch.device("cpu"), shared=False)
        self._registered: tuple[int, int] | None = None
        self.http = httpx.AsyncClient(timeout=cfg.timeout_s)

    def _source(self, need: int) -> torch.Tensor:
        buf = self.staging.get(need)
        key = (buf.data_ptr(), buf.numel())
        if self._registered != key:
            if self._registered is not None:
                self.te.unregister_memory(self._registered[0])
            if self.te.register_memory(*key) != 0:
                raise RuntimeError("Mooncake could not register the trainer's staging buffer")
            self._registered = key
        return buf

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        async def one(e: Engine) -> None:
            agent = self.cfg.mooncake_agents[e.index]
            r = await self.http.get(f"{agent}/info")
            r.raise_for_status()
            e.extra["agent"], e.extra["info"] = agent, r.json()

        return await _each(engines, one)

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        nbytes = bucket_nbytes(bucket)
        flat, meta = flatten_into(self._source(nbytes), bucket)
        rows = [[m.name, list(m.shape), dtype_name(m.dtype), m.start_idx, m.end_idx] for m in meta]

        async def one(e: Engine) -> None:
            info = e.extra["info"]
            if nbytes > info["size"]:
                raise RuntimeError(
                    f"bucket of {nbytes} bytes exceeds the agent's {info['size']}-byte buffer; "
                    "start the agent with --buffer-bytes >= sync.bucket_bytes"
                )
            rc = await asyncio.to_thread(
                self.te.transfer_sync_write, info["session"], flat.data_ptr(), info["addr"], nbytes
            )
            if rc != 0:
                raise RuntimeError(f"Mooncake write to {info['session']} failed ({rc})")
            r = await self.http.post(f"{e.extra['agent']}/load", json={"metadata": rows})
            data = r.json()
            if r.status_code != 200 or not data.get("success", False):
                raise RuntimeError(f"agent {e.extra['agent']}: {data.get('message', r.text)}")
            e.applied += 1

        return await _each(engines, one)

    def close(self) -> None:
        if self._registered is not None:
            self.te.unregister_memory(self._registered[0])
            self._registered = None
