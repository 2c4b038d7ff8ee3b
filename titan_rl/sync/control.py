"""The trainer ranks' side of a sync: who sends, and how the phases meet.

A sync runs in three phases on every trainer rank: the coordinator (global rank 0) pauses the
engines and shares the plan (:meth:`TrainerRanks.share`); every sender (a pipeline stage's or
an EP rank's source, :class:`~titan_core.models.hf.SendRole`) sends its own buckets; the
coordinator gathers what each sender saw (:meth:`TrainerRanks.gather`), then commits, bumps
the version and resumes the engines. No tensor crosses trainer ranks for the sync beyond the
TP / expert-TP gathers inside a stage.

:meth:`TrainerRanks.mutex` serialises the broadcasts of the ``distributed`` transport: an
engine applies one update request at a time, so two senders broadcasting in their own groups
at once could each hold an engine the other one waits for (slime takes a lock per bucket for
the same reason). The mutex lives in the trainer's default TCP store.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store


@dataclass(frozen=True)
class Sender:
    """This rank as one of the sync's senders."""

    #: unique among the senders (``pp_0``, ``pp_1-ep_1``): names its weight-update group
    name: str
    #: position among the senders (global rank order) and how many there are
    index: int
    count: int


@dataclass
class Report:
    """What one sender saw, gathered by the coordinator."""

    #: url -> (what failed, whether the engine was unreachable)
    failures: dict[str, tuple[str, bool]] = field(default_factory=dict)
    #: url -> buckets the engine applied from this sender
    applied: dict[str, int] = field(default_factory=dict)
    bytes: int = 0
    buckets: int = 0
    transfer_s: float = 0.0


class TrainerRanks:
    """The trainer's default process group as the sync uses it (one rank without one)."""

    COORDINATOR = 0
    #: how often a rank waiting for the mutex looks again
    POLL_S = 0.002

    def __init__(self) -> None:
        initialized = dist.is_initialized()
        self.rank = dist.get_rank() if initialized else 0
        self.world = dist.get_world_size() if initialized else 1
        #: other ranks to talk to (a group of one answers every collective itself: a
        #: broadcast or gather of objects there still pickles, ~0.5 ms each)
        self.distributed = initialized and self.world > 1

    @property
    def coordinator(self) -> bool:
        return self.rank == self.COORDINATOR

    def share(self, obj: Any) -> Any:
        """The coordinator's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.COORDINATOR)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on the coordinator (rank order), None elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.coordinator else None
        dist.gather_object(obj, out, dst=self.COORDINATOR)
        return out

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def acquire(self, key: str) -> None:
        """Take the trainer-wide mutex ``key`` (a spin lock on the default store); blocks."""
        if not self.distributed:
            return
        store, me = _get_default_store(), str(self.rank).encode()
        while store.compare_set(key, "", me) != me:
            time.sleep(self.POLL_S)

    def release(self, key: str) -> None:
        if not self.distributed:
            return
        _get_default_store().set(key, "")

    @contextlib.contextmanager
    def mutex(self, key: str) -> Iterator[None]:
        """Held by one trainer rank at a time."""
        self.acquire(key)
        try:
            yield
        finally:
            self.release(key)
