"""The HTTP routes of the built-in engine, one router per concern."""

from titan_rl.engine.routes import admin, generate, info, weights

ROUTERS = (info.router, generate.router, admin.router, weights.router)

__all__ = ["ROUTERS"]
