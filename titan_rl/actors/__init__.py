"""Ray actors of the RL loop: rollout engines (SGLang or the CPU engine) behind sglang-router."""

from titan_rl.actors.config import (
    EngineLaunch,
    EngineServerConfig,
    PlacedEngine,
    RolloutEnginesConfig,
    RouterConfig,
    resolve_backend,
)
from titan_rl.actors.engine_actor import RolloutEngine, RolloutEngineGroup
from titan_rl.actors.recovery import EngineLostError, EngineRecovery
from titan_rl.actors.router import RouterProcess, build_router_command
from titan_rl.actors.server import ServerProcess, build_command

__all__ = [
    "EngineLaunch",
    "EngineLostError",
    "EngineRecovery",
    "EngineServerConfig",
    "PlacedEngine",
    "RolloutEngine",
    "RolloutEngineGroup",
    "RolloutEnginesConfig",
    "RouterConfig",
    "RouterProcess",
    "ServerProcess",
    "build_command",
    "build_router_command",
    "resolve_backend",
]
