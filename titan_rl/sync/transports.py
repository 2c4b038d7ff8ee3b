"""The four ways buckets reach the engines. Each sends every bucket to every live engine and
reports failures per engine (it never raises for one engine's error), so the caller can keep
the trainer ranks' gathers going and leave failed engines on their old weights.

Every sender rank (a pipeline stage's or EP rank's source, :mod:`titan_rl.sync.control`) runs
its own transport: :meth:`Transport.begin`, :meth:`~Transport.send` per bucket and
:meth:`~Transport.end`; the coordinator alone runs :meth:`~Transport.prepare` before the
senders and :meth:`~Transport.commit` after them. An engine of TP size t gets what its t
ranks need: t payloads per request (``tensor``), t ranks in each group (``distributed``).
"""

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
from titan_core.net import free_port, host_address
from titan_rl.rollout.engine_api import EngineClient
from titan_rl.sync import shm_reaper
from titan_rl.sync.config import SyncConfig
from titan_rl.sync.control import Sender, TrainerRanks
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
    #: its tensor-parallel size (0: not asked yet); one payload / group rank per TP rank
    tp_size: int = 0
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
        #: this rank as a sender (set by WeightSync before begin)
        self.sender = Sender("pp_0", 0, 1)
        self.ranks = TrainerRanks()

    async def prepare(self, engines: list[Engine], version: str) -> Failures:
        """Coordinator, before any sender begins."""
        return {}

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
        """A sender, before its first bucket; ``forget``: engines restarted since the last
        sync (they hold none of its earlier state)."""
        return {}

    @abstractmethod
    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures: ...

    async def submitted(self, task: asyncio.Future) -> None:
        """Return once ``task`` (a :meth:`send` just started) no longer needs the event loop to
        get its requests out: the caller then exports the next bucket, which holds the loop."""
        await asyncio.sleep(0)

    async def commit(self, engines: list[Engine], version: str) -> Failures:
        """Coordinator, after every sender ended."""
        return {}

    async def end(self, engines: list[Engine]) -> None:
        return None

    def restore_path(self, version: str) -> str | None:
        """A folder holding ``version``'s full weights, once committed (disk), else None."""
        return None

    def close(self) -> None:
        return None


def per_tp_rank(e: Engine, dump: Callable[[], str]) -> list[str]:
    """``serialized_named_tensors`` for ``e``: one entry per engine TP rank (SGLang's layout),
    each its own dump (a receiver's unpickling drops the reference its dump took)."""
    return [dump() for _ in range(max(e.tp_size, 1))]


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

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
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

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_tensor(
                per_tp_rank(e, lambda: dumps_bucket(flat, meta)),
                load_format="flattened_bucket",
                flush_cache=False,
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
        # one dump per engine TP rank: each unpickling drops the transfer reference it took
        payload_of = {e.url: per_tp_rank(e, lambda: dumps_named(named)) for e in engines}
        posted.set()

        async def one(e: Engine) -> None:
            await e.client.update_weights_from_tensor(
                payload_of[e.url], load_format="direct", flush_cache=False
            )
            e.applied += 1

        return await each_engine(engines, one)


class DiskTransport(Transport):
    """HF safetensors written to a hidden folder (each sender its own files), renamed into
    place, then loaded at commit. Senders on several hosts need ``sync.disk.dir`` on a shared
    filesystem."""

    incremental = False

    def __init__(self, cfg: SyncConfig, device: torch.device) -> None:
        super().__init__(cfg, device)
        self.root = Path(cfg.disk.dir or ".")
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
        for p in versions[: -self.cfg.disk.keep]:
            if p != current:
                shutil.rmtree(p, ignore_errors=True)


class DistributedTransport(Transport):
    """One weight-update group per sender with every engine (slime's layout: group
    ``<group_name>-pp_<stage>``, ``...-ep_<rank>`` for an EP rank sending its experts): the
    sender is group rank 0, engine i's TP rank k is rank ``1 + (TP sizes of engines before i)
    + k``. Each bucket is one broadcast from the sender's device (NCCL/MCCL on GPU, gloo on
    CPU) that reaches every engine at once. Senders take turns per bucket (the trainer-wide
    mutex, :mod:`titan_rl.sync.control`): an engine applies one update at a time.

    When an engine fails a bucket, or the membership changes (an engine restarted or lost),
    the group is formed again with the engines left, under a new name (``...-g<n>``), so the
    others go on taking the weights.
    """

    MUTEX = "titan/sync/distributed"

    def __init__(self, cfg: SyncConfig, device: torch.device, backend: str) -> None:
        super().__init__(cfg, device)
        accel = get_accelerator()
        if backend not in accel.weight_update_backends:
            raise ValueError(
                f"sync.distributed.backend {backend!r} is not available on the {accel.name} accelerator; "
                f"use one of {', '.join(accel.weight_update_backends)}, or leave it unset"
            )
        self.backend = backend
        self.group: Any = None
        #: the engines of ``group``, in group-rank order
        self.members: list[str] = []
        self.broken = False
        self.generation = 0
        self.staging = _Staging(device, shared=False)

    @property
    def name(self) -> str:
        base = f"{self.cfg.distributed.group_name}-{self.sender.name}"
        return base if self.generation == 0 else f"{base}-g{self.generation}"

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
        if set(forget) & set(self.members):
            self.broken = True
        return await self._ensure_group(engines)

    async def _ensure_group(self, engines: list[Engine]) -> Failures:
        urls = [e.url for e in engines]
        if self.group is not None and not self.broken and urls == self.members:
            return {}
        if self.group is not None:
            await self._leave([e for e in engines if e.url in self.members])
            self.generation += 1
        if not engines:
            return {}
        where = self.cfg.distributed
        address = host_address() if where.master_address == "auto" else where.master_address
        port = where.master_port + self.sender.index if where.master_port else 0
        port = port or free_port(address)
        world = 1 + sum(max(e.tp_size, 1) for e in engines)
        name = self.name
        join = asyncio.create_task(
            asyncio.to_thread(
                init_weights_update_group, address, port, 0, world, name, self.backend,
                self.cfg.timeout_s,
            )
        )  # fmt: skip
        offsets = [1 + sum(max(x.tp_size, 1) for x in engines[:i]) for i in range(len(engines))]

        async def one(e: Engine, offset: int) -> None:
            await e.client.init_weights_update_group(
                address, port, offset, world, name, self.backend
            )

        results = await asyncio.gather(
            *(one(e, o) for e, o in zip(engines, offsets, strict=True)), return_exceptions=True
        )
        failed = {
            e.url: r for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)
        }
        if failed:  # the rendezvous cannot complete without them; the next bucket retries
            join.cancel()  # with the others (the join times out on its own)
            self.generation += 1
            return failed
        self.group, self.members, self.broken = await join, urls, False
        return {}

    async def _leave(self, engines: list[Engine]) -> None:
        """Tear down the group: on the engines still there, then ours."""
        name = self.name
        await each_engine(engines, lambda e: e.client.destroy_weights_update_group(name))
        with contextlib.suppress(Exception):
            destroy_weights_update_group(self.group)
        self.group, self.members = None, []

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        failed = await self._ensure_group(engines)
        if failed:
            return failed
        flat, _ = flatten_into(self.staging.get(bucket_nbytes(bucket)), bucket)
        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        await asyncio.to_thread(self.ranks.acquire, self.MUTEX)
        try:
            reqs = [
                e.client.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=self.name,
                    load_format="flattened_bucket", flush_cache=False,
                )
                for e in engines
            ]  # fmt: skip
            pg = self.group
            *answers, bcast = await asyncio.gather(
                *reqs, asyncio.to_thread(lambda: pg.broadcast(flat, 0).wait()),
                return_exceptions=True,
            )  # fmt: skip
        finally:
            self.ranks.release(self.MUTEX)
        failures: Failures = {}
        for e, r in zip(engines, answers, strict=True):
            if isinstance(r, BaseException):
                failures[e.url] = r
            else:  # the engine answered after loading what it received
                e.applied += 1
        if failures or isinstance(bcast, BaseException):
            self.broken = True
        return failures

    async def end(self, engines: list[Engine]) -> None:
        return None  # the group persists across syncs; destroyed in close()

    async def destroy(self, engines: list[Engine]) -> None:
        if self.group is not None:
            await self._leave([e for e in engines if e.url in self.members])


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

    async def begin(self, engines: list[Engine], version: str, forget: list[str]) -> Failures:
        async def one(e: Engine) -> None:
            agent = self.cfg.mooncake.agents[e.index]
            r = await self.http.get(f"{agent}/info")
            r.raise_for_status()
            e.extra["agent"], e.extra["info"] = agent, r.json()

        return await each_engine(engines, one)

    async def send(self, engines: list[Engine], bucket: NamedTensors) -> Failures:
        nbytes = bucket_nbytes(bucket)
        flat, meta = flatten_into(self._source(nbytes), bucket)
        n = self.sender.count

        async def one(e: Engine) -> None:
            # the agent's buffer is split in one region per sender: they write concurrently
            info = e.extra["info"]
            region = info["size"] // n
            if nbytes > region:
                raise RuntimeError(
                    f"bucket of {nbytes} bytes exceeds this sender's {region}-byte region of the "
                    f"agent's buffer ({n} senders); start the agent with --buffer-bytes >= "
                    f"{n} x sync.bucket_bytes"
                )
            base = self.sender.index * region
            rows = [
                [m.name, list(m.shape), dtype_name(m.dtype), base + m.start_idx, base + m.end_idx]
                for m in meta
            ]
            rc = await asyncio.to_thread(
                self.te.transfer_sync_write, info["session"], flat.data_ptr(),
                info["addr"] + base, nbytes,
            )  # fmt: skip
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
