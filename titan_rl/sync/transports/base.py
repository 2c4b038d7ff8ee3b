"""What every weight-sync transport is: a :class:`Transport` subclass (one module each in
this package) and its settings section (``sync.<name>``, a :class:`TransportSection`).

Each transport sends every bucket to every live engine and reports failures per engine (it
never raises for one engine's error), so the caller can keep the trainer ranks' gathers going
and leave failed engines on their old weights.

Every sender rank (a pipeline stage's or EP rank's source, :mod:`titan_rl.sync.control`) runs
its own transport: :meth:`Transport.begin`, :meth:`~Transport.send` per bucket and
:meth:`~Transport.end`; the coordinator alone runs :meth:`~Transport.prepare` before the
senders and :meth:`~Transport.commit` after them. An engine of TP size t gets what its t
ranks need: t payloads per request (``tensor``), t ranks in each group (``distributed``).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from titan_core.config.loader import Section
from titan_rl.rollout.engine_api import EngineClient
from titan_rl.sync.control import Sender, TrainerRanks
from titan_rl.wire.bucket import NamedTensors

Failures = dict[str, BaseException]
#: where an export writes a tensor it builds: ``(name, shape, dtype) -> tensor``
ExportTarget = Callable[[str, torch.Size, torch.dtype], torch.Tensor]


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
    #: it keeps a prefix (radix) cache, which the sync flushes once generation is paused (the
    #: cached KV was computed with the old weights); False where its ``/get_server_info``
    #: says ``disable_radix_cache`` (SGLang's server argument; the built-in engine has none)
    prefix_cache: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def describe(e: BaseException) -> str:
    """One failure as the sync's messages name it: ``Type: message``."""
    return f"{type(e).__name__}: {e}"


async def each_engine(engines: list[Engine], fn: Callable[[Engine], Awaitable[Any]]) -> Failures:
    """``fn`` on every engine at once; the engines it raised for, with what it raised."""
    results = await asyncio.gather(*(fn(e) for e in engines), return_exceptions=True)
    return {e.url: r for e, r in zip(engines, results, strict=True) if isinstance(r, BaseException)}


def per_tp_rank(e: Engine, dump: Callable[[], str]) -> list[str]:
    """``serialized_named_tensors`` for ``e``: one entry per engine TP rank (SGLang's layout),
    each its own dump (a receiver's unpickling drops the reference its dump took)."""
    return [dump() for _ in range(max(e.tp_size, 1))]


class TransportSection(Section):
    """A transport's settings, the section ``sync.<name>``, and what it requires. A problem
    is a message naming the key and what to do (the caller raises it)."""

    def chosen_problem(self) -> str | None:
        """What these settings lack when ``sync.transport`` chooses this transport."""
        return None

    def engines_problem(self, num_engines: int, key: str | None = None) -> str | None:
        """What stops these settings from serving ``num_engines`` engines (``key``: the
        config key that counts them, for the message)."""
        return None

    def connect_problem(self, num_engines: int) -> str | None:
        """What stops these settings from syncing to ``num_engines`` running engines, with
        what the job started beside them filled in (:meth:`engines_problem`, and what only a
        job can provide)."""
        return self.engines_problem(num_engines)

    def machine_problem(self) -> str | None:
        """What this machine lacks to run the transport (its packages, its backends)."""
        return None


class Transport(ABC):
    """One way buckets reach the engines. A subclass names itself (``name``: its
    ``sync.transport`` value) and its settings' class; the table in
    :mod:`titan_rl.sync.transports` lists it."""

    #: its ``sync.transport`` value; its settings are the section ``sync.<name>``
    name: ClassVar[str]
    #: the class of its settings section
    settings_class: ClassVar[type[TransportSection]]
    #: what it does, in a few words (docs and messages)
    summary: ClassVar[str]
    #: True when one bucket per call is applied by the engine as it arrives (so a failure after
    #: the first bucket leaves it half-updated); False when the engine loads all at commit.
    incremental = True
    #: True when ``send`` of the next bucket may start before the previous one is applied
    #: (at most two in flight: the transport double-buffers its staging memory).
    pipelined = False
    #: True when the engines open what a sender shares in its node's memory (shared memory,
    #: CUDA / MUSA IPC handles): they must run on a node with trainer ranks.
    same_node = False

    def __init__(self, settings: TransportSection, device: torch.device, timeout_s: float) -> None:
        """``settings``: its section; ``timeout_s``: ``sync.timeout_s``, what one call to an
        engine may take."""
        self.settings = settings
        self.device = device
        self.timeout_s = timeout_s
        #: this rank as a sender (set by WeightSync before begin)
        self.sender = Sender("pp_0", 0, 1)
        self.ranks = TrainerRanks()

    def before_export(self, chunks: list[Any]) -> ExportTarget | None:
        """A sender, before its buckets are exported from ``chunks`` (the model's): where the
        export writes the tensors it builds, or None (temporaries)."""
        return None

    def warm(self) -> None:
        """What the first sync would do that can be done ahead, while the engines run the
        first rollout (a thread of :meth:`WeightSync.warm_up` calls it; the first sync waits
        for it)."""
        return None

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

    async def destroy(self, engines: list[Engine]) -> None:
        """Tear down what it keeps across syncs with ``engines`` (a process group), before
        :meth:`close`."""
        return None

    def close(self) -> None:
        return None
