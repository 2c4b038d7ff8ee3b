"""The group of rollout engines (their actors + the router) the RL loop talks to, driver side."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ray

from titan_rl.actors.config import EngineLaunch, PlacedEngine, RolloutEnginesConfig, RouterConfig
from titan_rl.actors.engine_process import ray_actor_class
from titan_rl.actors.recovery import EngineRecovery, Resync
from titan_rl.actors.router import RouterProcess

if TYPE_CHECKING:
    from titan_rl.placement import EnginePlacement

log = logging.getLogger("titan_rl.actors")


class RolloutEngineGroup:
    """Engine actors behind one sglang-router (driver side), from their launches, resolved
    before (the GRPO job's placement plan, or :meth:`from_config`); each actor takes its
    launch as is. ``router`` None or disabled: no router (one engine only).
    """

    def __init__(self, engines: Sequence[PlacedEngine], router: RouterConfig | None = None) -> None:
        if not engines:
            raise ValueError("an engine group needs at least one engine")
        self.engines = list(engines)
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

    def restarts(self) -> int:
        """Restarts of all engines by their supervisors since the start."""
        return sum(ray.get([a.restarts.remote() for a in self.actors]))

    def gave_up(self) -> list[str]:
        """URLs of the engines whose supervisor stopped restarting them."""
        lost = ray.get([a.gave_up.remote() for a in self.actors])
        return [u for u, g in zip(self.urls, lost, strict=True) if g]

    def supervision(self) -> dict[str, float]:
        """What the supervisors saw, as step metrics: ``engines/hung_restarts`` (engines killed
        and restarted for not answering their health probe, since the start; counted in
        ``engines/restarts`` too) and ``engines/unanswered_s`` (the longest an engine went
        without answering since the last call; 0: none went a probe without)."""
        seen = ray.get([a.supervision.remote() for a in self.actors])
        return {
            "engines/hung_restarts": sum(s["hung_restarts"] for s in seen),
            "engines/unanswered_s": max(s["unanswered_s"] for s in seen),
        }

    def recovery(self, resync: Resync, timeout_s: float, client: str) -> EngineRecovery:
        """The driver-side recovery of these engines (after :meth:`start`), talking to them
        with ``client`` (``engines.client``)."""
        return EngineRecovery(
            self.urls, resync, router=self.router, api_key=self.launch.api_key,
            version=self.launch.weight_version, timeout_s=timeout_s, gave_up=self.gave_up,
            supervision=self.supervision, client=client,
        )  # fmt: skip

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.actors:
            ray.get([a.stop.remote() for a in self.actors])
            for a in self.actors:
                ray.kill(a)
        self.actors = []
