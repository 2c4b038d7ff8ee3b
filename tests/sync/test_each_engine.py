"""One helper runs a call on every engine at once for the sync and its transports, and reports
the engines it failed on (it never raises for one engine's error)."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from titan_rl.rollout import EngineClient
from titan_rl.sync.transports import Engine, each_engine


def _engines(n: int) -> list[Engine]:
    return [Engine(f"http://engine{i}", cast(EngineClient, None), i) for i in range(n)]


def test_failures_come_back_by_url_and_the_others_run() -> None:
    engines = _engines(4)
    ran: list[int] = []

    async def call(e: Engine) -> Any:
        await asyncio.sleep(0.01 * (4 - e.index))  # finish in reverse order
        if e.index in (1, 3):
            raise ConnectionError(f"engine {e.index} is down")
        ran.append(e.index)
        return "ok"

    failures = asyncio.run(each_engine(engines, call))
    assert sorted(failures) == ["http://engine1", "http://engine3"]
    assert str(failures["http://engine3"]) == "engine 3 is down"
    assert sorted(ran) == [0, 2]


@pytest.mark.parametrize("n", [0, 1])
def test_no_failure_is_an_empty_map(n: int) -> None:
    async def call(e: Engine) -> None:
        return None

    assert asyncio.run(each_engine(_engines(n), call)) == {}
