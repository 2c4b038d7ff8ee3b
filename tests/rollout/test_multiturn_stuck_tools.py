"""Tool calls that never return (issue 33): a stuck sync call times out and is counted, yet
holds neither asyncio's default executor (every ``asyncio.to_thread`` of the driver) nor the
job's exit; a tool's threads are bounded; with isolation="process" a stuck call is killed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from stuck_tools import RELEASE, blocks_in_async_def, blocks_until_released, echo, spins

from titan_rl.rollout.tools import Tool, ToolEnv, ToolWorkers, stuck_calls

HERE = Path(__file__).resolve().parent
#: asyncio's default executor's threads (ThreadPoolExecutor's default)
DEFAULT_EXECUTOR_THREADS = min(32, (os.cpu_count() or 1) + 4)


def test_stuck_sync_tool_calls_neither_starve_the_driver_nor_hold_its_exit() -> None:
    n = DEFAULT_EXECUTOR_THREADS + 4  # more stuck calls than the default executor's threads
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "stuck_tool_job.py"), str(n)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
    )  # fmt: skip
    killer = threading.Timer(120, proc.kill)  # whatever happens, no hung test
    killer.start()
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"the job did not exit within 30 s of writing its results: {line}")
        exited_at = time.time()
    finally:
        killer.cancel()
    assert proc.returncode == 0 and line, proc.stderr.read() if proc.stderr else ""
    out = json.loads(line)
    assert out["samples"] == out["completed"] == n
    assert out["timeouts"] == n and out["stuck"] == n  # each one counted, each still running
    assert out["rollout_s"] < 60  # the 0.3 s timeouts, all at once (2 busy cores)
    # before: None, the default executor's threads all held by stuck calls for good
    assert out["to_thread_s"] is not None and out["to_thread_s"] < 4.0, out
    assert exited_at - out["done_at"] < 10.0  # the stuck threads do not hold the exit


@pytest.fixture
def released() -> object:
    RELEASE.clear()
    yield RELEASE
    RELEASE.set()  # no thread of this test outlives it


def test_a_tools_threads_are_bounded_and_a_freed_thread_serves_the_next_call(
    released: threading.Event,
) -> None:
    workers = ToolWorkers(max_threads=2)
    stuck = Tool("stuck", re.compile(r"S\((.*)\)"), fn=blocks_until_released, timeout_s=0.3,
                 workers=workers)  # fmt: skip
    other = Tool("echo", re.compile(r"E\((.*)\)"), fn=echo, timeout_s=5.0, workers=workers)
    env = ToolEnv([stuck, other])

    async def main() -> None:
        first = await asyncio.gather(env.step("S(1)"), env.step("S(2)"))
        assert all(r.call and r.call["timed_out"] for r in first)
        assert workers.stuck == 2 and stuck_calls() >= 2
        threads = threading.active_count()
        # the tool's two threads are taken: a third call waits for one and times out
        third = await env.step("S(3)")
        assert third.call == {"name": "stuck", "args": "3", "error": "timed out after 0.3 s",
                              "timed_out": True}  # fmt: skip
        assert workers.stuck == 2 and threading.active_count() == threads
        # another tool's calls go on, and so does asyncio's executor
        assert (await env.step("E(hi)")).call == {"name": "echo", "args": "hi", "result": "HI"}
        assert await asyncio.wait_for(asyncio.to_thread(lambda: 7), 2.0) == 7
        # a waiting call gets the thread of the first stuck call that ends
        patient = asyncio.ensure_future(dataclasses.replace(stuck, timeout_s=10.0).call("4"))
        await asyncio.sleep(0.2)
        assert not patient.done()
        released.set()
        assert await patient == "released 4"
        for _ in range(100):
            if workers.stuck == 0:
                break
            await asyncio.sleep(0.02)
        assert workers.stuck == 0

    asyncio.run(main())


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith(("Z", "X"))
    except (FileNotFoundError, ProcessLookupError):
        return True


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def test_process_isolation_kills_a_stuck_call_with_its_worker(tmp_path: Path) -> None:
    workers = ToolWorkers(max_processes=2)
    tools = [
        Tool("spin", re.compile(r"SPIN\((.*)\)"), fn=spins, timeout_s=1.0, isolation="process",
             workers=workers),
        Tool("block", re.compile(r"BLOCK\((.*)\)"), fn=blocks_in_async_def, timeout_s=1.0,
             isolation="process", workers=workers),
        Tool("echo", re.compile(r"E\((.*)\)"), fn=echo, isolation="process", workers=workers),
    ]  # fmt: skip
    env = ToolEnv(tools)
    before = stuck_calls()
    spin, block = tmp_path / "spin.pid", tmp_path / "block.pid"

    async def main() -> None:
        replies = await asyncio.gather(env.step(f"SPIN({spin})"), env.step(f"BLOCK({block})"))
        for r in replies:
            assert r.call is not None and r.call["timed_out"], r.call
        # the loop was never blocked: a timer set now fires on time
        t = time.monotonic()
        await asyncio.sleep(0.1)
        assert time.monotonic() - t < 1.0
        assert (await env.step("E(ok)")).call == {"name": "echo", "args": "ok", "result": "OK"}

    try:
        asyncio.run(main())
        for f in (spin, block):  # killed, not left spinning or blocked
            assert _wait_gone(int(f.read_text())), f
        assert stuck_calls() == before  # nothing left running in this process
    finally:
        workers.close()


def test_process_isolation_needs_a_function_a_worker_can_import() -> None:
    def closure(args: str) -> str:
        return args

    for fn in (lambda a: a, closure):
        with pytest.raises(ValueError, match="module-level function"):
            Tool("t", re.compile(r"T\((.*)\)"), fn=fn, isolation="process")
    with pytest.raises(ValueError, match="isolation must be 'thread' or 'process'"):
        Tool("t", re.compile(r"T\((.*)\)"), fn=echo, isolation="fork")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_threads"):
        ToolWorkers(max_threads=0)
