"""Nothing a job starts outlives it: a ``kill -9`` of the process holding an engine server
(the Ray actor of ``RolloutEngine``) takes the server with it, and the server's TP workers,
whichever thread started it: a thread of the actor's that ended since, or the supervisor's
watch thread after a restart. Before, the server went on, re-parented to pid 1 (~0.5 GB).

A stand-in parent (tests/rollout/engine_parent.py) starts the engine as the actor does; the
real actor is killed in the Ray test."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
#: the kill of the parent to the end of its server and the server's TP workers
GONE_WITHIN_S = 5.0


def _gone(pids: list[int], within_s: float = GONE_WITHIN_S) -> list[int]:
    """The pids of ``pids`` still running (zombies count as gone) ``within_s`` from now."""
    deadline = time.monotonic() + within_s
    while True:
        alive = [p for p in pids if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("tp_size", "restart"),
    [
        pytest.param(1, False, id="started-by-an-ended-thread"),
        # two engine starts of two TP ranks each: ~50 s on 2 busy cores
        pytest.param(2, True, id="tp2-restarted-by-the-watch-thread", marks=pytest.mark.slow),
    ],
)
def test_a_killed_parent_takes_its_engine_server_with_it(
    tiny_model: Path, tmp_path: Path, tp_size: int, restart: bool
) -> None:
    parent = subprocess.Popen(
        [sys.executable, str(REPO / "tests/rollout/engine_parent.py"), str(tiny_model),
         str(tmp_path), str(tp_size), "1" if restart else "0"],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    started: list[int] = []
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        assert line, f"the stand-in parent exited with {parent.wait()} before its engine served"
        server = json.loads(line)["server"]
        workers = [c.pid for c in psutil.Process(server).children(recursive=True)]
        started = [server, *workers]
        assert psutil.Process(server).ppid() == parent.pid
        assert len(workers) == tp_size - 1, workers
        parent.kill()
        parent.wait()
        assert _gone(started) == [], "the engine outlived the process that started it"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        _kill([p for p in started if _running(p)])


@pytest.mark.slow
def test_a_killed_ray_actor_takes_its_engine_server_with_it(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    from titan_rl.actors.config import EngineServerConfig, PlacedEngine
    from titan_rl.actors.engine_actor import RolloutEngineGroup

    monkeypatch.setenv("RAY_raylet_start_wait_time_s", "240")  # loaded CI machines start slowly
    launch = EngineServerConfig(
        model_path=str(tiny_model), backend="builtin", num_threads=1, log_dir=str(tmp_path),
        startup_timeout_s=120,
    ).launch("cpu")  # fmt: skip
    try:  # a fresh local cluster, never someone else's
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
        )  # fmt: skip
    except Exception as e:  # Ray's own start-up, before any Titan code runs
        ray.shutdown()
        pytest.skip(f"a local Ray cluster could not start on this machine: {e}")
    group = RolloutEngineGroup([PlacedEngine(launch)])
    server = None
    try:
        group.start()
        server = ray.get(group.actors[0].pid.remote())
        actor = psutil.Process(server).ppid()  # the Ray worker process running the actor
        assert "ray" in " ".join(psutil.Process(actor).cmdline()).lower()
        os.kill(actor, signal.SIGKILL)
        assert _gone([server]) == [], "the engine outlived the Ray actor holding it"
    finally:
        group.router = None
        group.actors = []  # the actor is dead: nothing to stop
        ray.shutdown()
        if server is not None:
            _kill([server] if _running(server) else [])
