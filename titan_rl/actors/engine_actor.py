"""Ray actors for rollout engines, and the group (engines + router) the RL loop talks to."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig
from titan_rl.actors.recovery import EngineRecovery, Resync
from titan_rl.actors.router import RouterProcess
from titan_rl.actors.server import ServerProcess

if TYPE_CHECKING:
    from titan_rl.placement import EnginePlacement

log = logging.getLogger("titan_rl.actors")


class RolloutEngine:
    """One rollout server owned by a Ray actor: started, supervised (restarted if it dies), stopped.

    Plain class so it can be used without Ray; ``RolloutEngineActor`` is its Ray actor.
    """

    def __init__(
        self,
        cfg: EngineServerConfig | dict[str, Any],
        name: str = "engine0",
        bind_node_ip: bool = False,
    ) -> None:
        if isinstance(cfg, dict):
            cfg = EngineServerConfig.model_validate(cfg)
        if bind_node_ip:  # reachable from the driver's node, wherever Ray placed this actor
            import ray

            cfg = cfg.model_copy(update={"host": ray.util.get_node_ip_address()})
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

    def gave_up(self) -> bool:
        """The server died and its supervisor stopped restarting it."""
        return self.server.gave_up

    def command(self) -> list[str]:
        return self.server.command()

    def wait_healthy(self, timeout_s: float | None = None) -> bool:
        self.server.wait_healthy(timeout_s)
        return True

    def stop(self) -> None:
        self.server.stop()


def _ray_actor_class() -> Any:
    import ray

    # The server process does the work; the actor itself needs no CPU reservation (placed
    # engines take their bundle's share through .options()).
    return ray.remote(num_cpus=0, max_restarts=0)(RolloutEngine)


class RolloutEngineGroup:
    """``num_engines`` engine actors behind one sglang-router (driver side).

    ``placements`` (one per engine, from titan_rl.placement) put each actor on its bundle of
    the job's placement group, with its device share and SGLang's base_gpu_id; without them
    the actors float and hold no resources.
    """

    def __init__(
        self, cfg: RolloutEnginesConfig, placements: Sequence[EnginePlacement] | None = None
    ) -> None:
        if placements is not None and len(placements) != cfg.num_engines:
            raise ValueError(f"{len(placements)} placements for {cfg.num_engines} engines")
        self.cfg = cfg
        self.placements = placements
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
        raise RuntimeError("several engines without a router: set engines.router=true")

    def start(self) -> str:
        import ray

        actor_cls = _ray_actor_class()
        server = self.cfg.server
        self.actors = []
        for i in range(self.cfg.num_engines):
            cfg, cls, bind = server.model_dump(), actor_cls, False
            if self.placements is not None:
                where = self.placements[i]
                cls, bind = actor_cls.options(**where.actor_options), where.bind_node_ip
                if where.base_gpu_id is not None:
                    cfg["base_gpu_id"] = where.base_gpu_id
            self.actors.append(cls.remote(cfg, name=f"engine{i}", bind_node_ip=bind))
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

    def restarts(self) -> int:
        """Restarts of all engines by their supervisors since the start."""
        import ray

        return sum(ray.get([a.restarts.remote() for a in self.actors]))

    def gave_up(self) -> list[str]:
        """URLs of the engines whose supervisor stopped restarting them."""
        import ray

        lost = ray.get([a.gave_up.remote() for a in self.actors])
        return [u for u, g in zip(self.urls, lost, strict=True) if g]

    def recovery(self, resync: Resync, timeout_s: float) -> EngineRecovery:
        """The driver-side recovery of these engines (after :meth:`start`)."""
        return EngineRecovery(
            self.urls, resync, router=self.router, api_key=self.cfg.server.api_key,
            version=self.cfg.server.weight_version, timeout_s=timeout_s, gave_up=self.gave_up,
        )  # fmt: skip

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
