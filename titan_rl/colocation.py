"""What the rollout engines do with their memory while the trainer trains.

Colocated engines (``engines.colocate=true``, on the trainer's devices, as slime lays them
out) hand their weights, KV cache and CUDA graphs to the trainer for the policy update and
take them back before the weight sync; engines on devices of their own keep everything.
Either way, an engine that is restarting is waited for before the sync.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from titan_rl.rollout import ClientOptions, make_engine_client
from titan_rl.step_timer import StepTimer

#: runs a coroutine to its end on the driver's event loop (``aio.run_until_complete``)
RunAsync = Callable[[Awaitable[Any]], Any]
#: waits until every engine answers (``EngineRecovery.wait_all_up``)
WaitEnginesUp = Callable[[], Awaitable[None]]


class EngineMemory:
    """Colocated engines' memory (SGLang's release / resume_memory_occupation, by tags),
    called on every engine directly (a router does not forward these)."""

    def __init__(self, urls: list[str], api_key: str | None, client: str) -> None:
        options = ClientOptions(api_key=api_key)
        self.clients = [make_engine_client(u, options, client=client) for u in urls]

    async def release(self) -> None:
        """Weights, KV cache and CUDA graphs: all of it, for the trainer."""
        await asyncio.gather(*(c.release_memory_occupation(None) for c in self.clients))

    async def resume(self, tags: list[str] | None) -> None:
        await asyncio.gather(*(c.resume_memory_occupation(tags) for c in self.clients))

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


class Colocation(Protocol):
    """The loop's view: ``with colocation.around_training(timer): <policy update>``."""

    def around_training(self, timer: StepTimer) -> AbstractContextManager[None]: ...

    def close(self) -> None: ...


class SeparateDevices:
    """Engines on devices of their own: their memory stays; a restarting one is waited for."""

    def __init__(self, run: RunAsync, engines_up: WaitEnginesUp) -> None:
        self._run = run
        self._engines_up = engines_up

    @contextmanager
    def around_training(self, timer: StepTimer) -> Iterator[None]:
        yield
        self._run(self._engines_up())

    def close(self) -> None:
        pass


class SharedDevices:
    """Engines on the trainer's devices: ``release`` before the policy update (timed as
    ``time/release``), ``resume`` after it (``time/resume``, waiting first for a restarting
    engine, whose memory could not be resumed).

    ``resume_kv_cache``: the weight sync resumes the KV cache once the new weights are
    loaded (``sync.resume_kv_cache``), so only the weights come back here.
    """

    def __init__(
        self, run: RunAsync, engines_up: WaitEnginesUp, memory: EngineMemory, resume_kv_cache: bool
    ) -> None:
        self._run = run
        self._engines_up = engines_up
        self.memory = memory
        self._tags = ["weights"] if resume_kv_cache else None

    def release(self) -> None:
        self._run(self.memory.release())

    def resume(self) -> None:
        self._run(self._engines_up())
        self._run(self.memory.resume(self._tags))

    @contextmanager
    def around_training(self, timer: StepTimer) -> Iterator[None]:
        with timer.phase("release"):
            self.release()
        yield
        with timer.phase("resume"):
            self.resume()

    def close(self) -> None:
        self._run(self.memory.aclose())


def colocation_for(
    colocate: bool,
    urls: list[str],
    api_key: str | None,
    resume_kv_cache: bool,
    run: RunAsync,
    engines_up: WaitEnginesUp,
    client: str,
) -> Colocation:
    """The strategy for ``engines.colocate``, over the engines at ``urls`` (``client``:
    ``engines.client``)."""
    if not colocate:
        return SeparateDevices(run, engines_up)
    return SharedDevices(run, engines_up, EngineMemory(urls, api_key, client), resume_kv_cache)
