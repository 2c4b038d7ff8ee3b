"""The GRPO job with ``sync.transport=mooncake`` and no ``sync.mooncake.agents``: each engine's
actor starts a Mooncake agent beside its engine (the engine's host, a free port), the trainer
writes every sync into them (the parity check after each scores the engines like the trainer),
and no agent outlives the job."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.procs import command_lines
from titan_core.training.metrics import read_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("mooncake") is None,
        reason="mooncake-transfer-engine is not installed",
    ),
]
REPO = Path(__file__).resolve().parents[2]
#: what an agent prints once it serves (titan_rl/sync/mooncake_agent.py)
READY = re.compile(r"mooncake agent ready on (http://\S+) -> (http://\S+)")


def _agents_serving(engine_urls: set[str]) -> list[int]:
    """Pids of the Mooncake agents running for any of ``engine_urls``."""
    found = []
    for pid, args in command_lines():
        agent = "titan_rl.sync.mooncake_agent" in args and "--engine-url" in args
        if agent and args[args.index("--engine-url") + 1] in engine_urls:
            found.append(pid)
    return found


def test_the_job_starts_an_agent_beside_each_engine(tmp_path: Path, base: Path) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    proc = subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
         f"policy.load={base}", f"run.dir={run_dir}", "run.num_steps=2",
         "run.eval_interval=null", "run.save_interval=null", "rollout.prompts_per_step=8",
         "rollout.n_samples_per_prompt=4", "train.micro_batch_size=32", "train.ppo_steps=1",
         "engines.num_engines=2", "engines.router=true", "sync.transport=mooncake",
         "sync.check_every=1", "sync.bucket_bytes=1000000"],
        capture_output=True, text=True, cwd=REPO, timeout=900, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:  # every sync went through the agents, and the engines serve its weights
        assert r["sync/logprob_abs_diff_mean"] < 1e-4, r
        assert r["sync/logprob_abs_diff_max"] < 1e-4, r
        assert r["sync/bytes"] > 0 and r["sync/buckets"] > 1, r

    # one agent per engine, each on its engine's host, logging beside it
    ready = {}
    for i in range(2):
        log = (run_dir / "logs" / f"engine{i}-agent.log").read_text()
        found = READY.search(log)
        assert found, log[-2000:]
        agent, engine = found.groups()
        assert urlsplit(agent).hostname == urlsplit(engine).hostname, found.group(0)
        ready[engine] = agent
    assert len(ready) == 2 and len(set(ready.values())) == 2, ready
    assert not _agents_serving(set(ready)), "an agent outlived the job"
