"""Fast checks of what an engine restart relies on: the client's retries last a time window
(from the first failure), not a number of attempts; the rollout refuses responses from a
weight version it does not accept and sends them again once the engines are current; the
recovery's accepted versions, and its errors for an engine that stays down."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from titan_core.net import free_port
from titan_rl.actors.recovery import EngineLostError, EngineRecovery
from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout import RetryPolicy, SGLangClient, SGLangUnavailableError
from titan_rl.rollout.generate import (
    MAX_RESENDS,
    StaleVersionError,
    VersionCheck,
    evaluate,
    generate_groups,
)
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample

FAST = {"initial_backoff_s": 0.001, "max_backoff_s": 0.002}


def _answer(body: dict[str, Any], version: str) -> httpx.Response:
    n = body["sampling_params"].get("n", 1)
    outs = [
        {
            "output_ids": [49, 0],
            "meta_info": {
                "id": "r",
                "finish_reason": {"type": "stop", "matched": 0},
                "prompt_tokens": 1,
                "completion_tokens": 2,
                "weight_version": version,
                "output_token_logprobs": [[-0.1, 49, None], [-0.2, 0, None]],
            },
        }  # fmt: skip
        for _ in range(n)
    ]
    return httpx.Response(200, json=outs if n > 1 else outs[0])


def test_retries_outlast_a_count_and_stop_at_the_window() -> None:
    """Twelve refused connections (a server restarting) and then an answer: the request gets
    through (five retries did not). A server that never comes back: the error names the
    window and the number of attempts."""
    calls = {"n": 0}

    def restarting(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        if calls["n"] <= 12:
            raise httpx.ConnectError("connection refused", request=request)
        return _answer(json.loads(request.content), "7")

    def dead(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    async def main() -> None:
        retry = RetryPolicy(timeout_s=60.0, **FAST)
        async with SGLangClient(
            "http://engine", retry=retry, transport=httpx.MockTransport(restarting)
        ) as c:
            out = await c.generate([1], {"max_new_tokens": 2})
            assert out.weight_version == "7" and calls["n"] == 13 and c.retried == 12
        retry = RetryPolicy(timeout_s=0.3, initial_backoff_s=0.01, max_backoff_s=0.02)
        async with SGLangClient(
            "http://engine", retry=retry, transport=httpx.MockTransport(dead)
        ) as c:
            with pytest.raises(SGLangUnavailableError, match=r"retry window 0.3s") as err:
                await c.generate([1], {"max_new_tokens": 2})
            assert "ConnectError" in str(err.value) and c.retried >= 2

    asyncio.run(main())


class _DiesMidGeneration(httpx.AsyncBaseTransport):
    """The first /generate runs past the retry window, then its server dies (the connection
    drops); the second is answered."""

    def __init__(self) -> None:
        self.calls = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.calls += 1
        if self.calls == 1:
            await asyncio.sleep(0.3)
            raise httpx.RemoteProtocolError("server disconnected", request=request)
        return _answer(json.loads(request.content), "1")


def test_the_window_opens_at_the_first_failure_not_the_first_attempt() -> None:
    transport = _DiesMidGeneration()

    async def main() -> str | None:
        retry = RetryPolicy(timeout_s=0.1, **FAST)
        async with SGLangClient("http://engine", retry=retry, transport=transport) as c:
            return (await c.generate([1], {"max_new_tokens": 2}, rid="same")).weight_version

    assert asyncio.run(main()) == "1" and transport.calls == 2


def test_retry_policy_rejects_negative_settings() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        RetryPolicy(timeout_s=-1)
    with pytest.raises(ValueError, match="max_retries"):
        RetryPolicy(max_retries=-1)


class _Engine:
    """Serves weight version ``version``; ``current()`` (the recovery's wait) moves it to
    ``"1"`` after ``stale_answers`` answers from ``"0"``."""

    def __init__(self, stale_answers: int) -> None:
        self.version = "0"
        self.stale_left = stale_answers
        self.waits = 0
        self.sent = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if request.url.path == "/abort_request":
            return httpx.Response(200)
        self.sent += 1
        version = self.version
        if version == "0":
            self.stale_left -= 1
        return _answer(body, version)

    async def current(self) -> None:
        self.waits += 1
        if self.stale_left <= 0:
            self.version = "1"


async def _reward(samples: list[Sample]) -> RewardCounts:
    for s in samples:
        s.reward = 1.0
    return RewardCounts()


def _rollout(engine: _Engine, on_stale: str, groups: int = 3) -> Any:
    cfg = RolloutConfig(prompts_per_step=groups, n_samples_per_prompt=2, max_concurrency=1)
    prompts = [Prompt(text=f"{i}+1=", label="1", metadata={}) for i in range(groups)]
    versions = VersionCheck(frozenset({"1"}), on_stale, engine.current)  # type: ignore[arg-type]

    async def main() -> Any:
        async with SGLangClient(
            "http://engine", max_concurrency=1, transport=httpx.MockTransport(engine)
        ) as c:
            return await generate_groups(
                c, prompts, lambda t: [ord(x) for x in t], lambda ids: "1", cfg, [0], _reward,
                want_groups=groups, seed=3, versions=versions,
            )  # fmt: skip

    return asyncio.run(main())


def test_responses_from_another_version_are_refused_and_sent_again() -> None:
    engine = _Engine(stale_answers=1)  # the first group comes back from version 0
    result = _rollout(engine, "resend")
    assert {s.weight_version for s in result.samples} == {"1"}
    assert len(result.samples) == 6 and result.stale_samples == 2
    assert engine.sent == 4 and engine.waits == 1  # one group twice, after one wait


def test_keep_counts_the_stale_responses_and_keeps_them() -> None:
    engine = _Engine(stale_answers=1)
    result = _rollout(engine, "keep")  # never waits, so the engine stays on version 0
    assert [s.weight_version for s in result.samples] == ["0"] * 6
    assert result.stale_samples == 6 and engine.sent == 3 and engine.waits == 0


def test_an_engine_that_never_catches_up_is_an_error_naming_the_versions() -> None:
    engine = _Engine(stale_answers=10**6)
    with pytest.raises(StaleVersionError, match=r"\['0'\].*\['1'\]"):
        _rollout(engine, "resend", groups=1)
    assert engine.sent == MAX_RESENDS + 1


def test_evaluation_also_refuses_stale_responses() -> None:
    engine = _Engine(stale_answers=1)

    async def main() -> float:
        async with SGLangClient("http://engine", transport=httpx.MockTransport(engine)) as c:
            return await evaluate(
                c, [Prompt("1+0=", "1", {})], lambda t: [1], lambda ids: "1", 4, [0], _reward,
                VersionCheck(frozenset({"1"}), "resend", engine.current),
            )  # fmt: skip

    assert asyncio.run(main()) == 1.0 and engine.sent == 2 and engine.version == "1"


def test_recovery_accepts_the_synced_version_and_in_async_mode_the_trained_one() -> None:
    recovery = EngineRecovery(["http://127.0.0.1:1"], lambda urls, v: {}, version="0")
    assert recovery.accepted == {"0"} and recovery.target == "0"
    recovery.on_sync("3")
    assert recovery.accepted == {"3"} and recovery.target == "3"
    recovery.on_train_queued("4")  # a resync now queues behind step 4's training
    assert recovery.accepted == {"3", "4"} and recovery.target == "4"
    recovery.on_sync("4")
    assert recovery.accepted == {"4"} and recovery.target == "4"


def test_an_engine_its_supervisor_gave_up_on_stops_the_wait_naming_it() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine is down
    recovery = EngineRecovery(
        [url], lambda urls, v: {}, version="1", timeout_s=600, interval_s=0.01,
        gave_up=lambda: [url],
    )  # fmt: skip

    async def main() -> None:
        try:
            await recovery.ensure_serving()
        finally:
            await recovery.aclose()

    with pytest.raises(EngineLostError, match=f"engine {url} died and its supervisor gave up"):
        asyncio.run(main())


def test_an_engine_down_past_the_window_stops_the_wait() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    recovery = EngineRecovery([url], lambda urls, v: {}, timeout_s=0.05, interval_s=0.01)

    async def main() -> None:
        try:
            await recovery.wait_all_up()
        finally:
            await recovery.aclose()

    with pytest.raises(EngineLostError, match=r"engines.retry_timeout_s=0.05"):
        asyncio.run(main())
