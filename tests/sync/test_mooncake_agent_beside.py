"""The Mooncake agent an engine's actor starts beside its engine (the GRPO job's
``sync.transport=mooncake`` without ``sync.mooncake.agents``): on the engine's host, it loads
the trainer's weights into the engine, and again into the engine its supervisor restarted
(same URL, same agent); it dies with the process that owns the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.sync.test_sync import HAVE_MOONCAKE, run_worker, tiny_qwen3

pytestmark = [
    pytest.mark.slow,  # ~25 s: an engine, its agent, two trainer processes, a restart
    pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake-transfer-engine not installed"),
]
REPO = Path(__file__).resolve().parents[2]

#: the engine's owner (what the Ray actor is in the job): prints its engine's and agent's
#: URLs and pids; on "kill" kills its engine and says when the supervisor restarted it
OWNER = """
import json, os, signal, sys, time
from titan_rl.actors.config import EngineServerConfig, MooncakeAgentLaunch
from titan_rl.actors.engine_process import RolloutEngine

model, logs = sys.argv[1:3]
launch = EngineServerConfig(
    model_path=model, backend="builtin", num_threads=1, log_dir=logs, startup_timeout_s=120
).launch(mooncake_agent=MooncakeAgentLaunch(buffer_bytes=1 << 20))
engine = RolloutEngine(launch, name="engine0")
engine.start()
print(json.dumps({"url": engine.url(), "agent": engine.agent_url(), "pid": engine.pid(),
                  "agent_pid": engine.agent.pid}), flush=True)
for line in sys.stdin:
    os.kill(engine.pid(), signal.SIGKILL)
    while engine.restarts() < 1:
        time.sleep(0.2)
    engine.wait_healthy()
    print("restarted", engine.pid(), flush=True)
"""


def _gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":  # dead, not yet reaped by its (new) parent
            return True
        time.sleep(0.1)
    return False


def test_the_agent_beside_an_engine_outlives_its_restart_and_dies_with_its_owner(
    tmp_path: Path,
) -> None:
    model = tiny_qwen3(tmp_path / "model", seed=0)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TITAN_CONFIG", None)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(model), str(tmp_path / "logs")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert owner.stdout is not None and owner.stdin is not None
        started = json.loads(owner.stdout.readline())
        url, agent = started["url"], started["agent"]
        assert urlsplit(agent).hostname == urlsplit(url).hostname  # the engine's host
        assert urlsplit(agent).port != urlsplit(url).port

        def sync() -> dict:
            (r,) = run_worker(
                tmp_path, "--engines", url, "--model-dir", str(model), "--transports",
                "mooncake", "--agents", agent, "--supervised",
            )  # fmt: skip
            assert "error" not in r, r
            return r

        first = sync()
        assert first["metrics"]["sync/logprob_abs_diff_max"] < 1e-4, first
        # the supervisor restarts the engine on its start-up weights, at the same URL: the
        # same agent loads the trainer's weights into it
        owner.stdin.write("kill\n")
        owner.stdin.flush()
        said = owner.stdout.readline().split()
        assert said[0] == "restarted" and int(said[1]) != started["pid"], said
        again = sync()
        assert again["before"]["sync/logprob_abs_diff_max"] > 0.1, again  # start-up weights
        assert again["metrics"]["sync/logprob_abs_diff_max"] < 1e-4, again
        assert again["engine_versions"] == {url: again["version"]}
    finally:
        owner.kill()  # kill -9 of the owner, as of a Ray actor: no agent or engine is left
        owner.wait()
    assert _gone(started["agent_pid"]), "the agent outlived its owner"
    assert _gone(int(said[1])), "the engine outlived its owner"
