"""The real sglang-router in front of two built-in engines; one engine killed mid-batch."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from titan_rl.actors.config import EngineServerConfig, RouterConfig
from titan_rl.actors.router import RouterProcess
from titan_rl.actors.server import ServerProcess
from titan_rl.rollout import RetryPolicy, SGLangClient

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RouterProcess, list[ServerProcess]]]:
    logs = tmp_path_factory.mktemp("router-logs")
    engines = [
        ServerProcess(
            EngineServerConfig(
                model_path=str(tiny_model),
                backend="builtin",
                num_threads=1,
                log_dir=str(logs),
                startup_timeout_s=120,
            ),
            name=f"router-engine{i}",
        )
        for i in range(2)
    ]
    router = RouterProcess(
        RouterConfig(
            policy="round_robin",
            health_check_interval_secs=1,
            health_failure_threshold=1,
            log_dir=str(logs),
        ),
    )
    try:
        for e in engines:  # start both, then wait: the two start-ups overlap
            e.start(wait=False)
        router.start(wait=False)
        for p in (*engines, router):
            p.wait_healthy()
        for e in engines:
            router.add_worker(e.url)
        yield router, engines
    finally:
        router.stop()
        for e in engines:
            e.stop()


def _info(url: str) -> dict:
    return httpx.get(url + "/get_server_info", timeout=10).json()


def test_router_spreads_requests_over_engines(
    cluster: tuple[RouterProcess, list[ServerProcess]],
) -> None:
    router, engines = cluster
    assert sorted(w["url"] for w in router.workers()) == sorted(e.url for e in engines)
    before = [_info(e.url)["generated_tokens"] for e in engines]

    async def main() -> list:
        async with SGLangClient(router.url) as client:
            return await asyncio.gather(
                *[
                    client.generate([i + 3, 4], {"max_new_tokens": 6, **GREEDY}, rid=f"spread-{i}")
                    for i in range(8)
                ]
            )

    outs = asyncio.run(main())
    assert sorted(o.rid for o in outs) == sorted(f"spread-{i}" for i in range(8))
    assert all(len(o.output_ids) == 6 and o.weight_version == "default" for o in outs)
    after = [_info(e.url)["generated_tokens"] for e in engines]
    assert all(a > b for a, b in zip(after, before, strict=True)), (
        "round_robin should use both engines"
    )


def test_engine_killed_mid_batch_requests_finish_on_the_other(
    cluster: tuple[RouterProcess, list[ServerProcess]],
) -> None:
    router, (victim, survivor) = cluster
    prompts = [[i + 10, (7 * i) % 50 + 3, 5] for i in range(16)]
    rids = [f"kill-{i}" for i in range(16)]
    params = {"max_new_tokens": 120, **GREEDY}

    async def main() -> list:
        retry = RetryPolicy(max_retries=10, initial_backoff_s=0.2, max_backoff_s=1.0)
        async with SGLangClient(router.url, retry=retry) as client:
            tasks = [
                asyncio.create_task(client.generate(p, params, rid=r))
                for p, r in zip(prompts, rids, strict=True)
            ]
            deadline = time.monotonic() + 20
            while _info(victim.url)["num_running_reqs"] == 0:  # the victim has work in flight
                assert time.monotonic() < deadline, "the victim engine never received requests"
                await asyncio.sleep(0.02)
            os.killpg(victim.pid, signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 120)

    outs = asyncio.run(main())
    assert victim._proc.wait(5) is not None
    # none lost, none duplicated: one answer per rid, each for its own prompt
    assert [o.rid for o in outs] == rids
    assert all(o.finish_reason == {"type": "length", "length": 120} for o in outs)
    assert [o.prompt_tokens for o in outs] == [3] * 16
    with httpx.Client(base_url=survivor.url, timeout=60) as c:
        expected = c.post(
            "/generate", json={"input_ids": prompts, "sampling_params": params}
        ).json()
    assert [o.output_ids for o in outs] == [e["output_ids"] for e in expected]


_ORPHAN = """
import sys, time
from titan_rl.actors.config import RouterConfig
from titan_rl.actors.router import RouterProcess
router = RouterProcess(RouterConfig(log_dir=sys.argv[1]))
router.start(wait=True)
print(router._proc.pid, flush=True)
time.sleep(600)
"""


def test_router_dies_with_the_driver(tmp_path: Path) -> None:
    """A ``kill -9`` of the process that started the router (the GRPO driver) stops it too."""
    import os
    import signal
    import subprocess
    import sys

    import psutil

    driver = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        router_pid = int(driver.stdout.readline())
        assert psutil.pid_exists(router_pid)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        gone, _ = psutil.wait_procs([psutil.Process(router_pid)], timeout=30)
        assert gone, "the router outlived the driver"
    finally:
        driver.kill()


def test_two_routers_on_one_machine(tmp_path: Path) -> None:
    """Two jobs (or a test beside a run) each start a router: both serve (the routers'
    metrics exporters no longer share sglang-router's fixed default port)."""
    routers = [RouterProcess(RouterConfig(log_dir=str(tmp_path)), name=f"r{i}") for i in (0, 1)]
    try:
        for r in routers:
            r.start(wait=True)
        for r in routers:
            assert httpx.get(r.url + "/workers", timeout=10).status_code == 200
    finally:
        for r in routers:
            r.stop()
