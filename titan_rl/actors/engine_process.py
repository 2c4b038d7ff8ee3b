"""The Ray actor that owns one rollout server process: started, supervised, stopped.

Its own module, light on purpose: a Ray worker imports it to become the actor, and the
worker's start is on the job's start-up path (the server process imports torch and the
model's code itself; the actor needs neither).
"""

from __future__ import annotations

from typing import Any

from titan_core.net import NODE_IP_ENV
from titan_rl.actors.config import EngineLaunch
from titan_rl.actors.server import AgentProcess, ServerProcess
from titan_rl.nodes import enter_driver_dir


class RolloutEngine:
    """One rollout server owned by a Ray actor: started, supervised (restarted if it dies), stopped;
    with the Mooncake agent its launch names (``mooncake_agent``) beside it, started once the
    engine answers and stopped with it.

    Plain class so it can be used without Ray; ``RolloutEngineActor`` is its Ray actor.
    """

    def __init__(self, launch: EngineLaunch, name: str = "engine0") -> None:
        enter_driver_dir()  # on a cluster: relative paths (the model, the logs) as the driver's
        if launch.bind_node_ip:  # reachable from the driver's node, wherever Ray placed it
            import ray

            ip = ray.util.get_node_ip_address()  # its server, and its gloo groups, bind there
            launch = launch.model_copy(update={"host": ip, "env": {**launch.env, NODE_IP_ENV: ip}})
        self.server = ServerProcess(launch, name=name)
        self.agent = AgentProcess(self.server, f"{name}-agent") if launch.mooncake_agent else None

    def start(self) -> str:
        url = self.server.start(wait=True)
        self.server.watch()
        if self.agent is not None:  # on the engine's host, once the engine answers
            self.agent.start(wait=True)
            self.agent.watch()
        return url

    def url(self) -> str:
        return self.server.url

    def agent_url(self) -> str | None:
        """The URL of the Mooncake agent beside the engine (None: the launch names none)."""
        return None if self.agent is None else self.agent.url

    def pid(self) -> int | None:
        return self.server.pid

    def alive(self) -> bool:
        return self.server.alive()

    def restarts(self) -> int:
        return self.server.restarts

    def supervision(self) -> dict[str, float]:
        """The supervisor's counts: restarts (all), hung restarts (killed for not answering
        its health probe), and the longest the server went unanswered since the last call."""
        return {
            "restarts": float(self.server.restarts),
            "hung_restarts": float(self.server.hung_restarts),
            "unanswered_s": self.server.silence.take_longest(),
        }

    def gave_up(self) -> bool:
        """The server died and its supervisor stopped restarting it."""
        return self.server.gave_up

    def command(self) -> list[str]:
        return self.server.command()

    def wait_healthy(self, timeout_s: float | None = None) -> bool:
        self.server.wait_healthy(timeout_s)
        return True

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop()
        self.server.stop()


def ray_actor_class() -> Any:
    import ray

    # The server process does the work; the actor itself needs no CPU reservation (placed
    # engines take their bundle's share through .options()).
    return ray.remote(num_cpus=0, max_restarts=0)(RolloutEngine)
