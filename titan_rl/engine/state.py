"""What the routes of one server share: the engine, its weight-update groups and locks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Request

from titan_rl.engine.core import Engine
from titan_rl.engine.mapped import MappedStorages, mapped_limit

R = TypeVar("R")


@dataclass
class ServerState:
    """One app's state (``app.state.server``); routes take it as the :data:`State` dependency."""

    engine: Engine
    max_request_bytes: int
    served_model_name: str | None = None
    #: weight update process groups by name (``/init_weights_update_group``)
    groups: dict[str, Any] = field(default_factory=dict)
    mapped: MappedStorages = field(init=False)
    #: closed while a weight update waits or runs; generation waits for it
    gate: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)

    def __post_init__(self) -> None:
        self.mapped = MappedStorages(mapped_limit(self.engine))
        self.gate.set()

    async def on_engine(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` on the engine's thread, between decode steps."""
        return await asyncio.wrap_future(self.engine.call(fn))

    async def update_on_engine(self, fn: Callable[[], R]) -> R:
        """Apply a weight update as SGLang's model_update_lock does: unless generation is
        paused, wait for running requests to finish (new ones wait for the update), so no
        response mixes two weight versions."""
        async with self.update_lock:
            self.gate.clear()
            try:
                while not self.engine.paused and self.engine.num_in_flight() > 0:
                    await asyncio.sleep(0.01)
                return await self.on_engine(fn)
            finally:
                self.gate.set()


def server_state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(server_state)]
