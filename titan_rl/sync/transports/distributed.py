"""``sync.transport: distributed``: a process group per sender with every engine, one
broadcast per bucket (SGLang's ``update_weights_from_distributed``)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import torch
from pydantic import Field

from titan_core.accelerator import get_accelerator
from titan_core.net import free_port, host_address, node_address
from titan_rl.sync.transports.base import Engine, Failures, Transport, TransportSection, each_engine
from titan_rl.sync.transports.staging import Staging
from titan_rl.wire.bucket import NamedTensors, bucket_nbytes, dtype_name, flatten_into
from titan_rl.wire.group import destroy_weights_update_group, init_weights_update_group


class DistributedSync(TransportSection):
    """``sync.distributed``: a process group per sender (each pipeline stage's source rank,
    each EP rank sending its experts) with every engine; one broadcast per bucket."""

    #: the address each sender hosts its group's rendezvous on, as the engines reach it;
    #: "auto": each sender's own node address (senders on several hosts; what a GRPO job on
    #: a Ray cluster, ``ray.address``, uses when this is left unset).
    master_address: str = "127.0.0.1"
    #: rendezvous port of sender 0 (sender i: this + i); 0 picks free ones.
    master_port: int = Field(0, ge=0, lt=65536)
    #: the process groups' name prefix (a stage's group: ``<group_name>-pp_<stage>``; an EP
    #: rank sending its experts alone: ``<group_name>-pp_<stage>-ep_<rank>``).
    group_name: str = "titan"
    #: process-group backend (None: the accelerator's weight-update backend).
    backend: str | None = None

    def machine_problem(self) -> str | None:
        return _backend_problem(self.backend)


def _backend_problem(backend: str | None) -> str | None:
    accel = get_accelerator()
    if backend in (None, *accel.weight_update_backends):
        return None
    return (
        f"sync.distributed.backend={backend}: not available on the {accel.name} "
        f"accelerator; use one of {', '.join(accel.weight_update_backends)}, or leave it "
        "unset (the accelerator's own)"
    )


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

    name = "distributed"
    settings_class = DistributedSync
    summary = "broadcast from each sender to every engine over a process group"
    MUTEX = "titan/sync/distributed"

    def __init__(self, settings: DistributedSync, device: torch.device, timeout_s: float) -> None:
        super().__init__(settings, device, timeout_s)
        # the broadcast carries tensors staged on the trainer's device
        backend = settings.backend or get_accelerator().weight_update_backend_for(device.type)
        problem = _backend_problem(backend)
        if problem:
            raise ValueError(problem)
        self.where = settings
        self.backend = backend
        self.group: Any = None
        #: the engines of ``group``, in group-rank order
        self.members: list[str] = []
        self.broken = False
        self.generation = 0
        self.staging = Staging(device, shared=False)

    @property
    def group_name(self) -> str:
        base = f"{self.where.group_name}-{self.sender.name}"
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
        where = self.where
        address = where.master_address
        if address == "auto":  # this sender's node: the one Ray placed it on, else the host's
            address = node_address() or host_address()
        port = where.master_port + self.sender.index if where.master_port else 0
        port = port or free_port(address)
        world = 1 + sum(max(e.tp_size, 1) for e in engines)
        name = self.group_name
        join = asyncio.create_task(
            asyncio.to_thread(
                init_weights_update_group, address, port, 0, world, name, self.backend,
                self.timeout_s,
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
        name = self.group_name
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
                    names, dtypes, shapes, group_name=self.group_name,
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
        return None  # the group persists across syncs; destroyed in destroy()

    async def destroy(self, engines: list[Engine]) -> None:
        if self.group is not None:
            await self._leave([e for e in engines if e.url in self.members])
