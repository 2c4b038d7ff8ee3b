"""Engines that die mid-step: back in service on the current policy (driver side).

An engine's supervisor (``ServerProcess.watch``) restarts a dead server with its own command
line, so the restarted engine loads the run's start-up weights (``hf_start``) and reports the
start-up weight version. :class:`EngineRecovery` finds it by that version, takes it out of the
router, has the trainer send it the weights the trainer holds (``WeightSync.resync``: the last
synced ones, or in async mode the ones the next sync will label), checks that it now reports
the current version, and puts it back in the router. Until then the rollout refuses its
responses by their version (``titan_rl.rollout.generate.VersionCheck``) and waits in
:meth:`EngineRecovery.ensure_serving`. An engine that stops answering is said in the log
(its URL, for how long) and again when it answers; its supervisor kills one that does not
answer its health probe for ``engines.health_timeout_s`` and restarts it as a dead one
(titan_rl/actors/health.py), whose counts :meth:`EngineRecovery.report` adds to the step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from titan_rl.rollout import ClientOptions, EngineClient, make_engine_client
from titan_rl.rollout.engine_clients import DEFAULT_CLIENT

if TYPE_CHECKING:
    from titan_rl.actors.router import RouterProcess

log = logging.getLogger("titan_rl.actors")

T = TypeVar("T")

#: resync(urls, version) -> metrics: the trainer sends its weights to those engines as version
Resync = Callable[[list[str], str], dict[str, float]]
#: while an engine does not answer, say so again this often (seconds)
SAY_DOWN_EVERY_S = 30.0


class EngineLostError(RuntimeError):
    """An engine stayed down (its supervisor gave up, or the retry window ran out)."""


class EngineRecovery:
    """Watches the engines' weight versions and gives a restarted engine the current weights.

    ``accepted``: the versions the rollout takes now; ``target``: the version the trainer's
    weights carry once its queued work is done (what a resync labels them); both start at
    ``version``, the engines' start-up one. ``gave_up`` (optional) names the engines whose
    supervisor stopped restarting them; ``supervision`` (optional) the supervisors' step
    metrics (``engines/hung_restarts``, ``engines/unanswered_s``), added to :meth:`report`.
    """

    def __init__(
        self,
        urls: Iterable[str],
        resync: Resync,
        *,
        router: RouterProcess | None = None,
        api_key: str | None = None,
        version: str = "default",
        timeout_s: float = 900.0,
        interval_s: float = 1.0,
        gave_up: Callable[[], list[str]] | None = None,
        why_lost: Callable[[str], str | None] | None = None,
        supervision: Callable[[], dict[str, float]] | None = None,
        client: str = DEFAULT_CLIENT,
    ) -> None:
        """``client``: the engine client's name (``engines.client``); ``why_lost``: why an
        engine ``gave_up`` named is lost (None: its supervisor gave up)."""
        self.urls = list(urls)
        if not self.urls:
            raise ValueError("EngineRecovery needs at least one engine URL")
        self.resync = resync
        self.router = router
        self.api_key = api_key
        self.client = client
        self.timeout_s = timeout_s
        self.interval_s = interval_s
        self.gave_up = gave_up
        self.why_lost = why_lost
        self.supervision = supervision
        self.accepted: frozenset[str] = frozenset()
        self.target = ""
        self._serving_version = ""
        #: engines seen on an accepted version by the last check
        self.current: set[str] = set()
        #: engines the router lists (after the last check); all of them without a router
        self.listed: set[str] = set(self.urls)
        self._down_since: dict[str, float] = {}
        self._say_down_at: dict[str, float] = {}
        self._clients: dict[str, EngineClient] = {}
        self._lock: asyncio.Lock | None = None
        #: engines given the current weights since the last take_metrics()
        self.resyncs = 0
        self._metrics: dict[str, float] = {}
        self._last_error = ""
        self.on_sync(version)

    # ---- the versions the rollout accepts --------------------------------------------------
    def on_sync(self, version: str) -> None:
        """Every engine now serves ``version``, and the trainer holds it."""
        self._serving_version = version
        self.accepted, self.target = frozenset({version}), version

    def on_train_queued(self, version: str) -> None:
        """Async rollout: the trainer trains what the next sync labels ``version`` while the
        engines still serve the last synced one; a resync queues behind that training and
        sends ``version``, so both are accepted."""
        self.accepted = frozenset({self._serving_version, version})
        self.target = version

    # ---- checks ----------------------------------------------------------------------------
    def _client(self, url: str) -> EngineClient:
        if url not in self._clients:
            options = ClientOptions(api_key=self.api_key)
            self._clients[url] = make_engine_client(url, options, client=self.client)
        return self._clients[url]

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def _versions(self) -> dict[str, str | None]:
        found = await asyncio.gather(*(self._client(u).weight_version() for u in self.urls))
        return dict(zip(self.urls, found, strict=True))

    async def _try_check(self) -> None:
        """:meth:`check`, where only EngineLostError is fatal (a router or an engine that
        does not answer one round is asked again the next)."""
        try:
            await self.check()
        except EngineLostError:
            raise
        except Exception as e:
            log.warning("engine check failed (retrying): %s: %s", type(e).__name__, e)

    async def check(self) -> None:
        """One round: note the engines that are down, resync the ones on another version,
        and (behind a router) list exactly the engines on an accepted version."""
        async with self._get_lock():
            asked = time.monotonic()
            versions = await self._versions()
            now = time.monotonic()
            down = self._note_down(versions, asked, now)
            stale = [u for u, v in versions.items() if v is not None and v not in self.accepted]
            self.current = {u for u, v in versions.items() if v in self.accepted}
            await self._route()  # take the down and stale ones out before the resync
            if down:
                await self._check_down(down, now)
            if stale:
                await self._resync(stale)
                await self._route()

    def _note_down(self, versions: dict[str, str | None], asked: float, now: float) -> list[str]:
        """The engines that did not answer when asked at ``asked``; since when each has been
        down, said in the log (then every SAY_DOWN_EVERY_S, and once it answers again)."""
        down = [u for u, v in versions.items() if v is None]
        for u in self.urls:
            if u in down:
                since = self._down_since.setdefault(u, asked)
                if now >= self._say_down_at.get(u, since):
                    log.warning(
                        "engine %s has not answered for %.0fs; waiting for it (its supervisor "
                        "restarts it if it exits, or does not answer its health probe for "
                        "engines.health_timeout_s)", u, now - since,
                    )  # fmt: skip
                    self._say_down_at[u] = now + SAY_DOWN_EVERY_S
            elif (since := self._down_since.pop(u, None)) is not None:
                self._say_down_at.pop(u, None)
                log.warning("engine %s answers again after %.0fs without an answer", u, now - since)
        return down

    async def _route(self) -> None:
        if self.router is None:
            return
        router = self.router
        self.listed = {w.get("url") for w in await asyncio.to_thread(router.workers)}
        for u in self.urls:
            if u in self.listed and u not in self.current:
                await asyncio.to_thread(router.remove_worker, u)
                self.listed.discard(u)
                log.warning("%s: out of the router until it serves the current weights", u)
            elif u not in self.listed and u in self.current:
                await asyncio.to_thread(router.add_worker, u)
                self.listed.add(u)
                log.warning("%s: back in the router on weight version %s", u, self.target)

    async def _check_down(self, down: list[str], now: float) -> None:
        lost = await asyncio.to_thread(self.gave_up) if self.gave_up is not None else []
        gone = [u for u in down if u in lost]
        if gone:
            why = [(self.why_lost(u) if self.why_lost else None) for u in gone]
            raise EngineLostError("; ".join(
                w or f"engine {u} died and its supervisor gave up restarting it (max_restarts); "
                "see the engine's log under <run.dir>/logs" for u, w in zip(gone, why, strict=True)
            ))  # fmt: skip
        for u in down:
            if now - self._down_since[u] > self.timeout_s:
                raise EngineLostError(
                    f"engine {u} has not answered for {now - self._down_since[u]:.0f}s "
                    f"(engines.retry_timeout_s={self.timeout_s:g}); see its log under <run.dir>/logs"
                )

    async def _resync(self, stale: list[str]) -> None:
        log.warning(
            "engines %s serve another weight version than %s (restarted?): sending them the "
            "current weights", stale, sorted(self.accepted),
        )  # fmt: skip
        t0 = time.perf_counter()
        try:
            metrics = await asyncio.to_thread(self.resync, stale, self.target)
        except Exception as e:  # the next check tries again, within the retry window
            self._last_error = f"the resync of {stale} failed: {type(e).__name__}: {e}"
            log.warning("%s", self._last_error)
            return
        after = await asyncio.gather(*(self._client(u).weight_version() for u in stale))
        done = [u for u, v in zip(stale, after, strict=True) if v == self.target]
        if len(done) < len(stale):
            self._last_error = f"after a resync to {self.target}, {stale} report {after}"
        self.current |= set(done)
        self.resyncs += len(done)
        self._metrics = {**metrics, "engines/resync_s": time.perf_counter() - t0}

    def _serving(self) -> bool:
        """The endpoint serves an accepted version: the engine itself, or behind the router
        any engine (the router lists only current ones)."""
        if self.router is None:
            return set(self.urls) <= self.current
        return bool(self.current & self.listed)

    # ---- what the loop calls ---------------------------------------------------------------
    async def ensure_serving(self) -> None:
        """Return once the endpoint serves an accepted version; EngineLostError when it does
        not within the retry window."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            await self._try_check()
            if self._serving():
                return
            if time.monotonic() >= deadline:
                last = f"; last: {self._last_error}" if self._last_error else ""
                raise EngineLostError(
                    f"no engine served weight version {sorted(self.accepted)} within "
                    f"engines.retry_timeout_s={self.timeout_s:g}s; see the logs under "
                    f"<run.dir>/logs{last}"
                )
            await asyncio.sleep(self.interval_s)

    async def wait_all_up(self) -> None:
        """Return once every engine answers (a sync needs them all; it gives a restarted
        one the new weights itself)."""
        while True:
            asked = time.monotonic()
            versions = await self._versions()
            now = time.monotonic()
            down = self._note_down(versions, asked, now)
            if not down:
                return
            await self._check_down(down, now)
            await asyncio.sleep(self.interval_s)

    async def _watch(self) -> None:
        while True:
            await self._try_check()
            await asyncio.sleep(self.interval_s)

    async def guard(self, work: Awaitable[T]) -> T:
        """Run ``work`` (a rollout, an eval) while checking the engines every ``interval_s``;
        an EngineLostError from the checks cancels it and is raised."""
        main = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._watch())
        try:
            await asyncio.wait({main, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not main.done():
                main.cancel()
                await asyncio.gather(main, return_exceptions=True)
                watch.result()  # raises what stopped the checks
            return main.result()
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def report(self) -> dict[str, float]:
        """A check (after a sync it puts restarted engines back in the router), then
        ``engines/serving`` (engines on the current weights that take requests),
        ``engines/resyncs`` since the last report, the last resync's own metrics, and the
        supervisors' (``engines/hung_restarts``, ``engines/unanswered_s``)."""
        await self._try_check()
        out = {
            "engines/serving": float(len(self.current & self.listed)),
            "engines/resyncs": float(self.resyncs),
            **self._metrics,
        }
        if self.supervision is not None:
            out.update(await asyncio.to_thread(self.supervision))
        self.resyncs, self._metrics = 0, {}
        return out

    async def aclose(self) -> None:
        """Close the connections; the recovery can be used again on another event loop."""
        await asyncio.gather(*(c.aclose() for c in self._clients.values()))
        self._clients.clear()
        self._lock = None  # an asyncio.Lock belongs to the loop it was first used on
