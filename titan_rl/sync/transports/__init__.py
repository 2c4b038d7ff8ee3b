"""The weight-sync transports, one module each, and the one table of them
(:data:`TRANSPORTS`) that ``sync.transport``'s choices, the ``sync.<name>`` sections, the
config's checks, the sync's construction and the preflight read.

A new transport is a module here holding its :class:`~base.Transport` subclass (``name``,
``settings_class``; ``prepare`` and ``commit`` on the coordinator, ``begin``, ``send`` and
``end`` on every sender rank) and its settings section (a :class:`~base.TransportSection`),
and its line in the table below.
"""

from __future__ import annotations

from typing import Literal

from titan_rl.sync.transports.base import (
    Engine,
    Failures,
    Transport,
    TransportSection,
    each_engine,
)
from titan_rl.sync.transports.disk import DiskTransport
from titan_rl.sync.transports.distributed import DistributedTransport
from titan_rl.sync.transports.mooncake import MooncakeTransport
from titan_rl.sync.transports.tensor import TensorTransport

#: every transport sync.transport accepts, by name, in the order the config lists them
TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t for t in (TensorTransport, DistributedTransport, DiskTransport, MooncakeTransport)
}

#: sync.transport's type: the table's names
TransportName = Literal[tuple(TRANSPORTS)]  # type: ignore[valid-type]

__all__ = [
    "TRANSPORTS",
    "Engine",
    "Failures",
    "Transport",
    "TransportName",
    "TransportSection",
    "each_engine",
]
