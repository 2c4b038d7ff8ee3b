"""``sync.transport: tensor``: colocated engines, SGLang's ``update_weights_from_tensor``."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import torch
import torch.multiprocessing

from titan_rl.sync import shm_reaper
from titan_rl.sync.transports.base import (
    Engine,
    ExportTarget,
    Failures,
    Transport,
    TransportSection,
    each_engine,
    per_tp_rank,
)
from titan_rl.sync.transports.staging import Staging
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes, flatten_into, unflatten
from titan_rl.wire.payload import dumps_bucket, dumps_named


class TensorSync(TransportSection):
    """``sync.tensor``: SGLang's update_weights_from_tensor (colocated engines)."""

    #: what a request carries. flattened_bucket (default, what slime does): each bucket is
    #: copied into one staging buffer, so an engine opens one shared-memory segment / IPC
    #: handle per bucket, but the weights are copied twice (trainer, then engine). direct
    #: (``load_format="direct"``): the trainer's parameter tensors themselves (shared memory
    #: on CPU, where the first sync moves them, so /dev/shm must hold the model; CUDA/MUSA IPC
    #: on GPU), one copy (the engine's) instead of two. Temporaries (dtype casts, TP/EP/PP-
    #: gathered tensors, q/k/v on GPU) are still staged; on CPU q/k/v are written into shared
    #: memory kept for the run.
    format: Literal["flattened_bucket", "direct"] = "flattened_bucket"


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

    name = "tensor"
    settings_class = TensorSync
    summary = (
        "colocated: SGLang's update_weights_from_tensor (shared memory on CPU, CUDA/MUSA IPC "
        "on GPU)"
    )
    pipelined = True
    same_node = True
    #: direct format: staged tensors start at multiples of this (their views need no copy).
    ALIGN = 64
    #: direct format: event-loop turns the HTTP client is given to write the requests of a
    #: bucket before the next bucket's export holds the loop (see :meth:`submitted`).
    WRITE_TURNS = 8

    def __init__(self, settings: TensorSync, device: torch.device, timeout_s: float) -> None:
        super().__init__(settings, device, timeout_s)
        self.direct = settings.format == "direct"
        self.staging = [Staging(device), Staging(device)]
        self._turn = 0
        self._flattening: asyncio.Lock | None = None
        #: direct format on an accelerator: storage addresses of the model's parameters (set
        #: by before_export); other tensors of a bucket are temporaries and get staged.
        self.param_storages: set[int] = set()
        self._shadows: dict[str, torch.Tensor] = {}
        self._posted: asyncio.Event | None = None

    def warm(self) -> None:
        """On CPU: start torch's shared-memory manager and this process's reaper (the first
        shared tensor of a process spawns ``torch_shm_manager``, ~170 ms here)."""
        if self.device.type == "cpu":
            torch.multiprocessing.set_sharing_strategy("file_system")
            probe = torch.empty(1, dtype=torch.uint8).share_memory_()
            shm_reaper.track(probe.untyped_storage())

    def close(self) -> None:
        for s in self.staging:
            s.release()
        self._shadows.clear()

    def before_export(self, chunks: list[Any]) -> ExportTarget | None:
        """Direct format: the parameters themselves are sent, so on CPU they must live in
        shared memory, and q/k/v are written into shared-memory shadows (one copy, none in
        staging)."""
        if not self.direct:
            return None
        self.param_storages = share_parameters(chunks)
        return self.shadow if self.device.type == "cpu" else None

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
        if t.device.type == "cpu":  # before_export moved the parameters into shared memory
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


def share_parameters(chunks: list[Any]) -> set[int]:
    """Make the parameters sendable by reference (direct format); returns their storage
    addresses.

    On CPU a tensor reaches another process only through shared memory: every parameter's
    storage is moved there in place (once: later calls find them shared), so each sync sends
    the live parameters and the engine's copy is the only one. Sharing is by file name, which
    any local process can open (as the staging buffers are). On an accelerator the parameters
    travel as IPC handles as they are.
    """
    params = [p for chunk in chunks for p in chunk.parameters()]
    for p in params:
        if p.device.type == "cpu" and not p.data.is_shared():
            torch.multiprocessing.set_sharing_strategy("file_system")
            p.data.share_memory_()
            shm_reaper.track(p.untyped_storage())  # unlinked even after a kill -9
    return {p.untyped_storage().data_ptr() for p in params}
