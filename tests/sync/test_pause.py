"""The sync's pause: generation is paused on every engine, then the prefix caches of the
engines that keep one are flushed (their cached KV was computed with the old weights). An
engine that says ``disable_radix_cache`` in ``/get_server_info`` (SGLang's server argument;
the built-in engine, which keeps no prefix cache) is not asked to flush: one round trip less
per sync."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.models.hf_cases import build_hf_model
from titan_rl.engine.core import Engine as BuiltinEngine
from titan_rl.engine.server import create_app
from titan_rl.rollout import SGLangClient
from titan_rl.sync.sync import WeightSync, _pause
from titan_rl.sync.transports import Engine


class Recorded(httpx.AsyncBaseTransport):
    """Another transport's requests, their paths written down in order."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.paths = inner, []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        return await self.inner.handle_async_request(request)


def sglang_server(disable_radix_cache: bool | None) -> httpx.MockTransport:
    """An SGLang server's answers to the calls of a pause (server info as SGLang's
    ``/get_server_info`` gives its server arguments; None: a server that does not say)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/get_server_info":
            info: dict[str, Any] = {"tp_size": 2}
            if disable_radix_cache is not None:
                info["disable_radix_cache"] = disable_radix_cache
            return httpx.Response(200, json=info)
        if request.url.path == "/pause_generation":
            return httpx.Response(200, json={"success": True})
        if request.url.path == "/flush_cache":
            return httpx.Response(200, text="Cache flushed.")
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


async def _pause_round(transport: httpx.AsyncBaseTransport) -> Engine:
    """The coordinator's first steps of a sync on one engine: its server info, the pause."""
    async with SGLangClient("http://engine", transport=transport) as client:
        engine = Engine("http://engine", client, 0)
        await WeightSync._learn_server_info(engine)
        failures = await _pause([engine], "abort")
        assert failures == {}
        return engine


@pytest.fixture(scope="module")
def builtin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BuiltinEngine]:
    path: Path = tmp_path_factory.mktemp("pause-model") / "qwen2"
    build_hf_model("qwen2").save_pretrained(path)
    eng = BuiltinEngine(str(path), num_threads=1)
    yield eng
    eng.shutdown()


def test_the_builtin_engine_is_paused_without_a_flush(builtin: BuiltinEngine) -> None:
    recorded = Recorded(httpx.ASGITransport(app=create_app(builtin)))
    engine = asyncio.run(_pause_round(recorded))
    assert engine.prefix_cache is False and engine.tp_size == 1
    assert recorded.paths == ["/get_server_info", "/pause_generation"]
    assert builtin.paused
    builtin.paused = False


@pytest.mark.parametrize("disable_radix_cache", [False, None])
def test_an_sglang_server_with_a_prefix_cache_is_flushed_after_the_pause(
    disable_radix_cache: bool | None,
) -> None:
    recorded = Recorded(sglang_server(disable_radix_cache))
    engine = asyncio.run(_pause_round(recorded))
    assert engine.prefix_cache is True and engine.tp_size == 2
    assert recorded.paths == ["/get_server_info", "/pause_generation", "/flush_cache"]


def test_an_sglang_server_without_a_radix_cache_is_not_flushed() -> None:
    recorded = Recorded(sglang_server(True))
    engine = asyncio.run(_pause_round(recorded))
    assert engine.prefix_cache is False
    assert recorded.paths == ["/get_server_info", "/pause_generation"]
