"""Ray actors of the RL loop: rollout engines (SGLang or the CPU engine) behind sglang-router."""

from titan_rl.actors.config import EngineServerConfig, RolloutEnginesConfig, RouterConfig
from titan_rl.actors.engine_actor import RolloutEngine, RolloutEngineGroup
from titan_rl.actors.recovery import EngineLostError, EngineRecovery
from titan_rl.actors.router import RouterProcess, build_router_command
from titan_rl.actors.server import ServerProcess, build_command, free_port, resolve_backend

__all__ = [
    "EngineLostError",
    "EngineRecovery",
    "EngineServerConfig",
    "RolloutEngine",
    "RolloutEngineGroup",
    "RolloutEnginesConfig",
    "RouterConfig",
    "RouterProcess",
    "ServerProcess",
    "build_command",
    "build_router_command",
    "free_port",
    "resolve_backend",
]
