"""Rollout engines for slime / miles drivers: Titan's engines (the built-in CPU engine or
SGLang servers, ``titan_rl.actors``) behind handles with slime's engine-actor methods.

slime's ``RayTrainGroup`` (disk weight updates) and train actors talk to engines through
Ray actors with ``SGLangEngine``'s method names (``get_url``, ``pause_generation``,
``flush_cache``, ``update_weights_from_disk``, ``continue_generation``,
``get_weight_version``, ``release_memory_occupation``, ``resume_memory_occupation``).
:class:`EngineHandle` is such an actor over one engine's HTTP API (Titan's ``SGLangClient``).
"""

from __future__ import annotations

import asyncio
from typing import Any


class EngineHandle:
    """slime's engine-actor surface over one SGLang-API server (plain class; a Ray actor via
    :func:`engine_handles`)."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = url
        self.api_key = api_key
        self._loop = asyncio.new_event_loop()

    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        from titan_rl.rollout.client import SGLangClient

        async def go() -> Any:
            async with SGLangClient(self.url, api_key=self.api_key) as c:
                return await getattr(c, method)(*args, **kwargs)

        return self._loop.run_until_complete(go())

    def get_url(self) -> str:
        return self.url

    def health_generate(self, timeout: float = 5.0) -> bool:
        return bool(self._call("health", generate=True))

    def pause_generation(self) -> None:
        self._call("pause_generation", "abort")

    def continue_generation(self) -> None:
        self._call("continue_generation")

    def flush_cache(self) -> bool:
        return bool(self._call("flush_cache"))

    def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, **_: Any
    ) -> dict[str, Any]:
        version = None if weight_version is None else str(weight_version)
        return self._call("update_weights_from_disk", model_path, weight_version=version)

    def get_weight_version(self) -> str | None:
        return self._call("get_model_info").get("weight_version")

    def release_memory_occupation(self) -> None:
        self._call("release_memory_occupation", None)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self._call("resume_memory_occupation", tags)


def engine_handles(urls: list[str], api_key: str | None = None) -> list[Any]:
    """One :class:`EngineHandle` Ray actor per URL (no resources held: the servers are the
    engines' own processes)."""
    import ray

    cls = ray.remote(num_cpus=0)(EngineHandle)
    return [cls.remote(u, api_key) for u in urls]
