"""A built-in engine killed (-9) mid-rollout: its supervisor restarts it on the start-up
weights, EngineRecovery gives it the current ones before its answers count, and the rollout
ends with every sample from the current version and the tokens a rollout without the kill
gives. Alone (the client waits for it), and as one of two behind the real sglang-router
(the other serves meanwhile; the killed one rejoins on the current weights). The lone one is
supervised with ``max_restarts=1``: the one restart allowed is made, and stop() ends the
restarted server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from titan_rl.actors.config import EngineServerConfig, RouterConfig
from titan_rl.actors.recovery import EngineRecovery
from titan_rl.actors.router import RouterProcess
from titan_rl.actors.server import ServerProcess
from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout import RetryPolicy, SGLangClient
from titan_rl.rollout.generate import RolloutResult, VersionCheck, generate_groups
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample

pytestmark = pytest.mark.slow

ROLLOUT = RolloutConfig(
    prompts_per_step=8, n_samples_per_prompt=2, max_response_len=160, temperature=0.0,
    max_concurrency=64,
)  # fmt: skip
PROMPTS = [Prompt(text=f"{i}", label="", metadata={}) for i in range(8)]


def _supervised(model: Path, log_dir: Path, name: str, max_restarts: int = 2) -> ServerProcess:
    cfg = EngineServerConfig(
        model_path=str(model), backend="builtin", num_threads=1, log_dir=str(log_dir),
        startup_timeout_s=120, weight_version="0", max_restarts=max_restarts,
    )  # fmt: skip
    server = ServerProcess(cfg, name=name)
    server.start(wait=False)
    return server


def _load(url: str, model: Path, version: str) -> None:
    resp = httpx.post(
        f"{url}/update_weights_from_disk",
        json={"model_path": str(model), "weight_version": version},
        timeout=120,
    )
    assert resp.status_code == 200 and resp.json()["success"], resp.text


def _resync_from(model: Path) -> tuple[Callable[[list[str], str], dict[str, float]], list]:
    """The trainer's part, played by loading ``model`` (the current weights) from disk."""
    calls: list[tuple[list[str], str]] = []

    def resync(urls: list[str], version: str) -> dict[str, float]:
        calls.append((list(urls), version))
        for u in urls:
            _load(u, model, version)
        return {"resync/engines": float(len(urls))}

    return resync, calls


def _running(url: str) -> int:
    try:
        return int(httpx.get(f"{url}/get_server_info", timeout=5).json()["num_running_reqs"])
    except httpx.HTTPError:
        return 0


async def _reward(samples: list[Sample]) -> RewardCounts:
    for s in samples:  # token-dependent, so groups differ and none is filtered
        s.reward = float(len(s.response_tokens) % 2)
    return RewardCounts()


async def _rollout(client: SGLangClient, recovery: EngineRecovery) -> RolloutResult:
    versions = VersionCheck(recovery.accepted, "resend", recovery.ensure_serving)
    return await recovery.guard(
        generate_groups(
            client,
            PROMPTS,
            lambda t: [3 + int(t), 7, 5],
            lambda ids: "",
            ROLLOUT,
            [],
            _reward,
            want_groups=len(PROMPTS),
            seed=1,
            versions=versions,
        )  # fmt: skip
    )


async def _kill_when_busy(server: ServerProcess) -> None:
    deadline = time.monotonic() + 60
    while await asyncio.to_thread(_running, server.url) == 0:  # requests in flight
        assert time.monotonic() < deadline, "the engine never received the rollout's requests"
        await asyncio.sleep(0.01)
    os.killpg(server.pid, signal.SIGKILL)


def _tokens(result: RolloutResult) -> dict[tuple[int, int], list[int]]:
    return {(s.group_index, s.index): s.response_tokens for s in result.samples}


@pytest.fixture
def current_model(
    make_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    return make_model(tmp_path_factory.mktemp("current"), seed=1)


@pytest.fixture
def stop_after() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for p in started:
        p.stop()


def test_single_engine_killed_mid_rollout_finishes_on_the_current_weights(
    tiny_model: Path, current_model: Path, tmp_path: Path, stop_after: list[Any]
) -> None:
    # max_restarts=1: the one restart allowed is made
    server = _supervised(tiny_model, tmp_path, "lone", max_restarts=1)
    stop_after.append(server)
    server.wait_healthy()
    server.watch(interval_s=0.2)
    first = server.pid
    _load(server.url, current_model, "1")  # the run's first sync
    resync, calls = _resync_from(current_model)
    recovery = EngineRecovery([server.url], resync, version="1", timeout_s=120, interval_s=0.2)

    async def main() -> tuple[RolloutResult, RolloutResult, int, dict[str, float]]:
        retry = RetryPolicy(timeout_s=120)
        async with SGLangClient(server.url, retry=retry, max_concurrency=64) as client:
            reference = await _rollout(client, recovery)
            killer = asyncio.create_task(_kill_when_busy(server))
            result = await _rollout(client, recovery)
            await killer
            report = await recovery.report()
            await recovery.aclose()
            return reference, result, client.retried, report

    reference, result, retried, report = asyncio.run(main())
    assert server.restarts == 1 and retried > 0
    assert server.alive() and server.pid != first
    assert calls and all(c == ([server.url], "1") for c in calls)
    assert {s.weight_version for s in result.samples} == {"1"}
    assert _tokens(result) == _tokens(reference)  # the same greedy answers: current weights
    assert report["engines/resyncs"] == len(calls) and report["engines/serving"] == 1
    server.stop()  # the restarted server stops with its supervisor
    assert not server.alive()


def test_one_of_two_engines_behind_the_router_killed_the_other_serves_it_rejoins(
    tiny_model: Path, current_model: Path, tmp_path: Path, stop_after: list[Any]
) -> None:
    victim, survivor = (_supervised(tiny_model, tmp_path, f"routed{i}") for i in range(2))
    router = RouterProcess(
        RouterConfig(
            policy="round_robin", health_check_interval_secs=1, health_failure_threshold=1,
            log_dir=str(tmp_path),
        )
    )  # fmt: skip
    stop_after.extend([router, victim, survivor])
    router.start(wait=False)
    for p in (victim, survivor, router):
        p.wait_healthy()
    for e in (victim, survivor):
        e.watch(interval_s=0.2)
        _load(e.url, current_model, "1")
        router.add_worker(e.url)
    resync, calls = _resync_from(current_model)
    recovery = EngineRecovery(
        [victim.url, survivor.url], resync, router=router, version="1", timeout_s=120,
        interval_s=0.2,
    )  # fmt: skip

    async def main() -> tuple[RolloutResult, RolloutResult, dict[str, float]]:
        async with SGLangClient(
            router.url, retry=RetryPolicy(timeout_s=120), max_concurrency=64
        ) as client:
            reference = await _rollout(client, recovery)
            killer = asyncio.create_task(_kill_when_busy(victim))
            result = await _rollout(client, recovery)
            await killer
            # what the loop does before its next sync and rollout: wait, then a check
            await recovery.wait_all_up()
            report = await recovery.report()
            await recovery.aclose()
            return reference, result, report

    reference, result, report = asyncio.run(main())
    assert report["engines/serving"] == 2
    assert victim.restarts == 1 and survivor.restarts == 0
    assert {s.weight_version for s in result.samples} == {"1"}
    assert _tokens(result) == _tokens(reference)
    # the killed engine rejoined: listed by the router again, on the current weights alone
    assert calls == [([victim.url], "1")]
    assert sorted(w["url"] for w in router.workers()) == sorted([victim.url, survivor.url])
    outs = [
        httpx.post(
            f"{e.url}/generate",
            json={"input_ids": [4, 7, 5], "sampling_params": {"max_new_tokens": 16}},
            timeout=60,
        ).json()
        for e in (victim, survivor)
    ]
    assert [o["meta_info"]["weight_version"] for o in outs] == ["1", "1"]
    assert outs[0]["output_ids"] == outs[1]["output_ids"]
