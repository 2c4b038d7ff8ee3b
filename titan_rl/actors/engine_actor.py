"""Ray actors for rollout engines, and the group (engines + router) the RL loop talks to."""

from __future__ import annotations

import logging
from typing import Any

from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig
from titan_rl.actors.router import RouterProcess
from titan_rl.actors.server import ServerProcess

log = logging.getLogger("titan_rl.actors")


class RolloutEngine:
    """One rollout server owned by a Ray actor: started, supervised (restarted if it dies), stopped.

    Plain class so it can be used without Ray; ``RolloutEngineActor`` is its Ray actor.
    """

    def __init__(self, cfg: EngineServerConfig | dict[str, Any], name: str = "engine0") -> None:
        if isinstance(cfg, dict):
            cfg = EngineServerConfig.model_validate(cfg)
        self.server = ServerProcess(cfg, name=name)

    def start(self) -> str:
        url = self.server.start(wait=True)
        self.server.watch()
        return url

    def url(self) -> str:
        return self.server.url

    def pid(self) -> int | None:
        return self.server.pid

    def alive(self) -> bool:
        return self.server.alive()

    def restarts(self) -> int:
        return self.server.restarts

    def command(self) -> list[str]:
        return self.server.command()

    def wait_healthy(self, timeout_s: float | None = None) -> bool:
        self.server.wait_healthy(timeout_s)
        return True

    def stop(self) -> None:
        self.server.stop()


def _ray_actor_class() -> Any:
    import ray

    # The server process does the work; the actor itself needs no CPU reservation.
    return ray.remote(num_cpus=0, max_restarts=0)(RolloutEngine)


class RolloutEngineGroup:
    """``num_engines`` engine actors behind one sglang-router (driver side)."""

    def __init__(self, cfg: RolloutEnginesConfig) -> None:
        self.cfg = cfg
        self.actors: list[Any] = []
        self.urls: list[str] = []
        self.router: RouterProcess | None = None

    @property
    def url(self) -> str:
        """The URL clients use: the router's, or the single engine's without a router."""
        if self.router is not None:
            return self.router.url
        if len(self.urls) == 1:
            return self.urls[0]
        raise RuntimeError("several engines without a router: enable rollout.router")

    def start(self) -> str:
        import ray

        actor_cls = _ray_actor_class()
        server = self.cfg.server
        self.actors = [
            actor_cls.remote(server.model_dump(), name=f"engine{i}")
            for i in range(self.cfg.num_engines)
        ]
        try:
            self.urls = ray.get([a.start.remote() for a in self.actors])
            if self.cfg.router.enabled:
                self.router = RouterProcess(self.cfg.router, api_key=server.api_key)
                self.router.start()
                for url in self.urls:
                    self.router.add_worker(url)
        except BaseException:
            self.stop()  # leave no half-started servers behind
            raise
        return self.url

    def stop(self) -> None:
        import ray

        if self.router is not None:
            self.router.stop()
            self.router = None
        if self.actors:
            ray.get([a.stop.remote() for a in self.actors])
            for a in self.actors:
                ray.kill(a)
        self.actors = []
