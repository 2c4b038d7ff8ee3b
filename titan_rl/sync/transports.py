"""The four ways buckets reach the engines. Each sends every bucket to every live engine and
reports failures per engine (it never raises for one engine's error), so the caller can keep
the trainer ranks' gathers going and leave failed engines on their old weights."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.multiprocessing

from titan_core.accelerator import get_accelerator
from titan_core.net import free_port
from titan_rl.rollout.engine_api import EngineClient
from titan_rl.sync import shm_reaper
from titan_rl.sync.config import SyncConfig
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes, dtype_name, flatten_into, unflatten
from titan_rl.wire.group import destroy_weights_update_group, init_weights_update_group
from titan_rl.wire.payload import dumps_bucket, dumps_named

Failures = dict[str, BaseException]


@dataclass
class Engine:
    """One rollout engine as the sync sees it."""

    url: str
    client: EngineClient
    index: int
    #: buckets this engine has applied in the current sync (0: still on the old weights).
    applied: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


async def each_engine(engines: list[Engine], fn: Callable[[Engine], Awaitable[Any]]) -> Failures:
    """``fn`` on every engine at once; the engines it raised for, with what it raised."""
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

    async def submitted(self, task: asyncio.Future) -> None:
        """Return once ``task`` (a :meth:`send` just started) no longer needs the event loop to
        get its requests out: the caller then exports the next bucket, which holds the loop."""
        await asyncio.sleep(0)

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
            if self.shared:
                buf.share_memory_()
                shm_reaper.track(buf.untyped_storage())  # unlinked even after a kill -9
            self.buf = buf
        return self.buf

    def release(self) -> None:
        self.buf = None


class TensorTransport(Transport):
    """Colocated: ``update_weights_from_tensor``, one call per bucket.

    ``sync.tensor.format=flattened_bucket``: each bucket is copied into a staging buffer and
    sent as one flattened uint8 tensor. Two staging buffers alternate, so bucket k+1 is
    flattened (in a worker thread) while the engines load bucket k. Flattening is one bucket at
    a time: two copies at once would only share the memory bandwidth and leave the engines idle
    until both are done. The buffers live for the whole run: engines that keep the last
    buckets' storages open map them once, not on every sync.

    ``direct``: a ``[(name, tensor)]`` list whose tensors are the trainer's parameters (or
    views of them) where they live in persistent memory, so the engine's copy is the only one.
    On CPU the export writes q/k/v into shared-memory :meth:`shadow` tensors; other temporaries
    (dtype casts, gathered tensors, q/k/v on an accelerator) are staged as above and sent as
    views of the staging buffer. Two buckets in flight, as above.

    One request per bucket: on a 2-core machine, smaller requests overlapping the export of the
    next ones measured slower (the trainer's work then competes with the engine's for the
    cores, and each request costs a round trip and an unpickling).
    """

    pipelined = True
    #: direct format: staged tensors start at multiples of this (their views need no copy).
    ALIGN = 64
    #: direct format: event-loop turns the HTTP client is given to write the requests of a
    #: bucket before the next bucket's export holds the loop (see :meth:`submitted`).
    WRITE_TURNS = 8

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.direct = cfg.tensor.format == "direct"
        self.staging = [_Staging(device), _Staging(device)]
        self._turn = 0
        self._flattening: asyncio.Lock | None = None
        #: direct format on an accelerator: storage addresses of the model's parameters (set
        #: by WeightSync); other tensors of a bucket are temporaries and get staged.
        self.param_storages: set[int] = set()
        self._shadows: dict[str, torch.Tensor] = {}
        self._posted: asyncio.Event | None = None

    def close(self) -> None:
        for s in self.staging:
            s.release()
        self._shadows.clear()

    def shadow(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """Direct format on CPU: the shared-memory tensor the export writes ``name`` into when
        it builds it (q/k/v of a fused QKV), the same one every sync. Sent as it is, it costs
        the export's copy alone, where a temporary is copied again into the staging buffer;
        engines map it once. Costs shared memory of the size of those tensors for the run."""
        t = self._shadows.get(name)
        if t is None or t.shape != shape or t.dtype != dtype:
            torch.multiprocessing.set_sharing_strategy("file_system")
            t = torch.empty(shape, dtype=dtype).share_memory_()
            shm_reaper.track(t.untyped_storage())
            self._shadows[name] = t
        return t

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        # Every sync starts on the first buffer, so a model of one bucket reuses one mapping
        # (an engine maps a new segment page by page: ~3 ms per MiB under a sandboxed kernel).
        self._turn = 0
        self._flattening = asyncio.Lock()  # of this sync's event loop
        return {}

    async def _stage(self, bucket: NamedTensors, align: int = 1) -> tuple[torch.Tensor, list[Any]]:
        staging = self.staging[self._turn]
        self._turn ^= 1
        assert self._flattening is not None, "begin() opens every sync"
        async with self._flattening:
            flat, meta = await asyncio.to_thread(
                flatten_into, staging.get(bucket_nbytes(bucket, align)), bucket, align
            )
        if self.device.type != "cpu":
            torch.accelerator.synchronize()  # the copy must land before another process reads
        return flat, meta

    def persistent(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in memory the engine may read in place (a parameter's)."""
        storage = t.untyped_storage()
        if t.device.type == "cpu":  # WeightSync moved the parameters into shared memory
            return storage.is_shared()
        return storage.data_ptr() in self.param_storages

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        if self.direct:
            return await self._send_direct(engines, bucket)
        flat, meta = await self._stage(bucket)
        payload = dumps_bucket(flat, meta)

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_tensor(
                [payload], load_format="flattened_bucket", flush_cache=False
            )
            e.applied += 1

        return await each_engine(engines, one)

    async def submitted(self, task: asyncio.Future) -> None:
        await asyncio.sleep(0)  # the send starts, and sets _posted before it first waits
        posted = self._posted
        if not self.direct or posted is None:
            return
        waiter = asyncio.ensure_future(posted.wait())
        await asyncio.wait([waiter, task], return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        for _ in range(self.WRITE_TURNS):
            await asyncio.sleep(0)

    async def _send_direct(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        self._posted = posted = asyncio.Event()
        named = list(bucket)
        idx = [i for i, (_, t) in enumerate(named) if not self.persistent(t)]
        if idx:
            flat, meta = await self._stage([named[i] for i in idx], self.ALIGN)
            for i, (_, view) in zip(idx, unflatten(flat, meta), strict=True):
                named[i] = (named[i][0], view)
        # one dump per engine: each unpickling drops the transfer reference it took
        payloads = [dumps_named(named) for _ in engines]
        payload_of = {e.url: p for e, p in zip(engines, payloads, strict=True)}
        posted.set()

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_tensor(
                [payload_of[e.url]], load_format="direct", flush_cache=False
            )
            e.applied += 1

        return await each_engine(engines, one)


class DiskTransport(Transport):
    """HF safetensors written to a hidden folder, renamed into place, then loaded at commit."""

    incremental = False

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.root = Path(cfg.disk.dir or ".")
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

        failures = await each_engine(engines, one)
        self._prune(final)
        return failures

    def _prune(self, current: Path) -> None:
        versions = sorted(
            (p for p in self.root.glob("version-*") if p.is_dir()), key=lambda p: p.stat().st_mtime
        )
        for p in versions[: -self.cfg.disk.keep]:
            if p != current:
                shutil.rmtree(p, ignore_errors=True)


class DistributedTransport(Transport):
    """``init_weights_update_group`` once per engine, then a broadcast from the trainer."""

    def __init__(self, cfg: SyncConfig, device: torch.device, backend: str) -> None:
        super().__init__(cfg, device)
        accel = get_accelerator()
        if backend not in accel.weight_update_backends:
            raise ValueError(
                f"sync.distributed.backend {backend!r} is not available on the {accel.name} accelerator; "
                f"use one of {', '.join(accel.weight_update_backends)}, or leave it unset"
            )
        self.backend = backend
        self.groups: dict[str, Any] = {}
        self.staging = _Staging(device, shared=False)

    def _name(self, e: Engine) -> str:
        return f"{self.cfg.distributed.group_name}-{e.index}"

    async def begin(self, engines: list[Engine], version: str) -> Failures:
        async def one(e: Engine) -> None:
            if e.url in self.groups:
                return
            where = self.cfg.distributed
            port = where.master_port + e.index if where.master_port else 0
            port = port or free_port(where.master_address)
            args = (where.master_address, port, 0, 2, self._name(e), self.backend)
            join = asyncio.create_task(
                asyncio.to_thread(init_weights_update_group, *args, self.cfg.timeout_s)
            )
            try:
                await e.client.init_weights_update_group(
                    where.master_address, port, 1, 2, self._name(e), self.backend
                )
            except BaseException:
                join.cancel()
                raise
            self.groups[e.url] = await join

        return await each_engine(engines, one)

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

        return await each_engine(engines, one)

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

        mc = cfg.mooncake
        self.te = TransferEngine()
        rc = self.te.initialize(mc.host, "P2PHANDSHAKE", mc.protocol, mc.device)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake TransferEngine.initialize({mc.host!r}, P2PHANDSHAKE, "
                f"{mc.protocol!r}) failed with {rc}; check sync.mooncake.host"
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
            agent = self.cfg.mooncake.agents[e.index]
            r = await self.http.get(f"{agent}/info")
            r.raise_for_status()
            e.extra["agent"], e.extra["info"] = agent, r.json()

        return await each_engine(engines, one)

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

        return await each_engine(engines, one)

    def close(self) -> None:
        if self._registered is not None:
            self.te.unregister_memory(self._registered[0])
            self._registered = None
