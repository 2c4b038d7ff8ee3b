"""The group of rollout engines (their actors + the router) the RL loop talks to, driver side."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from titan_rl.actors.config import EngineLaunch, PlacedEngine, RolloutEnginesConfig, RouterConfig
from titan_rl.actors.engine_process import ray_actor_class
from titan_rl.actors.recovery import EngineRecovery, Resync
from titan_rl.actors.router import RouterProcess
from titan_rl.nodes import NodeWatch, RayNode

if TYPE_CHECKING:
    from titan_rl.placement import EnginePlacement

log = logging.getLogger("titan_rl.actors")

#: the longest an engine actor's answer is waited for (its calls are bookkeeping: a live
#: actor answers at once; a timed-out one counts as not answering)
ACTOR_TIMEOUT_S = 30.0
#: what :meth:`RolloutEngineGroup._ask` gives for an actor Ray reports dead
DIED = object()


class RolloutEngineGroup:
    """Engine actors behind one sglang-router (driver side), from their launches, resolved
    before (the GRPO job's placement plan, or :meth:`from_config`); each actor takes its
    launch as is. ``router`` None or disabled: no router (one engine only).
    """

    def __init__(
        self,
        engines: Sequence[PlacedEngine],
        router: RouterConfig | None = None,
        watch: NodeWatch | None = None,
    ) -> None:
        """``watch``: the job's node watch (an engine on a lost node is lost with it; its
        actor is not asked anything more)."""
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = list(engines)
        self.watch = watch
        #: why each lost engine (by URL) is lost, as :meth:`gave_up` found it
        self.lost_why: dict[str, str] = {}
        self.router_cfg = router if router is not None and router.enabled else None
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.router: RouterProcess | None = None

    @classmethod
    def from_config(
        cls, cfg: RolloutEnginesConfig, placements: Sequence[EnginePlacement] | None = None
    ) -> RolloutEngineGroup:
        """``cfg.num_engines`` servers resolved for this machine, each on its placement (its
        Ray options and SGLang's base_gpu_id, titan_rl.placement); without placements the
        actors float and hold no resources."""
        if placements is not None and len(placements) != cfg.num_engines:
            raise ValueError(f"{len(placements)} placements for {cfg.num_engines} engines")
        launch = cfg.server.launch()
        if placements is None:
            return cls([PlacedEngine(launch)] * cfg.num_engines, cfg.router)
        return cls([p.place(launch) for p in placements], cfg.router)

    @property
    def launch(self) -> EngineLaunch:
        """The first engine's launch (api_key, start-up weight version: the same for all)."""
        return self.engines[0].launch

    @property
    def url(self) -> str:
        """The URL clients use: the router's, or the single engine's without a router."""
        if self.router is not None:
            return self.router.url
        if len(self.urls) == 1:
            return self.urls[0]
        raise RuntimeError("several engines without a router: set engines.router=true")

    def start(self) -> str:
        actor_cls = ray_actor_class()
        self.actors = []
        for i, placed in enumerate(self.engines):
            opts = placed.actor_options
            cls = actor_cls if opts is None else actor_cls.options(**opts)
            self.actors.append(cls.remote(placed.launch, name=f"engine{i}"))
        try:
            self.urls = ray.get([a.start.remote() for a in self.actors])
            if self.router_cfg is not None:
                self.router = RouterProcess(self.router_cfg, api_key=self.launch.api_key)
                self.router.start()
                for url in self.urls:
                    self.router.add_worker(url)
        except BaseException:
            self.stop()  # leave no half-started servers behind
            raise
        return self.url

    def agent_urls(self) -> list[str] | None:
        """The Mooncake agents the actors started beside their engines (their launches'
        ``mooncake_agent``), in the engines' order, after :meth:`start`; None: they start
        none."""
        if not any(placed.launch.mooncake_agent for placed in self.engines):
            return None
        return ray.get([a.agent_url.remote() for a in self.actors])

    def describe(self) -> str:
        """Where the engines serve, in one line (after :meth:`start`): each URL (and its node
        on a cluster, where it binds the node's address), the Mooncake agents beside them,
        and the router's address and the URLs it lists."""
        where = [
            f"engine {i} at {url}"
            + (f" on node {placed.node}" if placed.node and placed.launch.bind_node_ip else "")
            for i, (placed, url) in enumerate(zip(self.engines, self.urls, strict=True))
        ]
        line = "engines: " + ", ".join(where)
        agents = self.agent_urls()
        if agents is not None:
            line += f"; mooncake agents at {', '.join(agents)}"
        if self.router is not None:
            listed = sorted(str(w.get("url")) for w in self.router.workers())
            line += f"; router at {self.router.url} listing {', '.join(listed)}"
        return line

    def _lost_nodes(self, check: bool = False) -> dict[RayNode, str]:
        """The engines' lost nodes: as the watch last found them, or ``check``ed now."""
        if self.watch is None:
            return {}
        return self.watch.lost() if check else self.watch.known_lost()

    def _ask(self, method: str, check: bool = False) -> list[Any]:
        """``method`` of every engine's actor: its answer, :data:`DIED` for an actor Ray
        reports dead, None for one that does not answer now (not asked at all on a lost node:
        the call would only wait; ``check``: the nodes checked first)."""
        lost = self._lost_nodes(check)
        refs = [
            None if placed.node in lost else getattr(actor, method).remote()
            for placed, actor in zip(self.engines, self.actors, strict=True)
        ]
        out: list[Any] = []
        for ref in refs:
            try:
                out.append(None if ref is None else ray.get(ref, timeout=ACTOR_TIMEOUT_S))
            except ActorDiedError:
                out.append(DIED)
            except (RayActorError, GetTimeoutError):  # unavailable for now, or slow
                out.append(None)
        return out

    def _answers(self, method: str) -> list[Any]:
        return [a for a in self._ask(method) if a is not None and a is not DIED]

    def restarts(self) -> int:
        """Restarts of all engines by their supervisors since the start (of those that
        answer)."""
        return sum(self._answers("restarts"))

    def gave_up(self) -> list[str]:
        """URLs of the engines lost for good: their supervisor stopped restarting them, their
        node is lost, or their actor died; why each is in :attr:`lost_why`."""
        lost_nodes = self._lost_nodes(check=True)  # asked when an engine does not answer
        answers = self._ask("gave_up")
        for i, (placed, url, answer) in enumerate(
            zip(self.engines, self.urls, answers, strict=True)
        ):
            if placed.node in lost_nodes:
                why = (
                    f"engine {i} ({url}) was on node {placed.node}, lost: {lost_nodes[placed.node]}"
                )
            elif answer is DIED:
                why = f"engine {i} ({url}): its Ray actor died"
            elif answer:
                why = (
                    f"engine {i} ({url}) died and its supervisor gave up restarting it "
                    "(max_restarts); see the engine's log under <run.dir>/logs"
                )
            else:
                continue
            self.lost_why.setdefault(url, why)
        return [u for u in self.urls if u in self.lost_why]

    def supervision(self) -> dict[str, float]:
        """What the supervisors saw, as step metrics: ``engines/restarts`` (as
        :meth:`restarts`, in the same round of calls), ``engines/hung_restarts`` (engines
        killed and restarted for not answering their health probe, since the start; counted
        in ``engines/restarts`` too) and ``engines/unanswered_s`` (the longest an engine went
        without answering since the last call; 0: none went a probe without)."""
        seen = self._answers("supervision")
        return {
            "engines/restarts": sum(int(s["restarts"]) for s in seen),
            "engines/hung_restarts": sum(s["hung_restarts"] for s in seen),
            "engines/unanswered_s": max((s["unanswered_s"] for s in seen), default=0.0),
        }

    def recovery(self, resync: Resync, timeout_s: float, client: str) -> EngineRecovery:
        """The driver-side recovery of these engines (after :meth:`start`), talking to them
        with ``client`` (``engines.client``)."""
        return EngineRecovery(
            self.urls, resync, router=self.router, api_key=self.launch.api_key,
            version=self.launch.weight_version, timeout_s=timeout_s, gave_up=self.gave_up,
            why_lost=self.lost_why.get, supervision=self.supervision, client=client,
        )  # fmt: skip

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.actors:
            self._ask("stop")  # not those whose node is lost: their calls would only wait
            for a in self.actors:
                with contextlib.suppress(Exception):  # an actor already gone
                    ray.kill(a)
        self.actors = []
