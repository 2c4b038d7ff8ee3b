"""The real GRPO job (Ray, a Megatron trainer actor, built-in engines) with an engine killed
(-9) in the middle of step 2's rollout: the supervisor restarts it, the trainer gives it the
weights of the last sync before it serves, and the step finishes on the current policy; every
step's samples carry the version of the sync before it, and the restarted engine scores the
parity probe like the trainer. Here as one of two engines behind the router (the other serves
meanwhile, the killed one rejoins on the current weights); the lone engine killed mid-rollout
is checked in tests/rl/test_engine_hang_e2e.py's job (after its stops, one job for both)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import command_lines
from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: sequences running or waiting on an engine above which it is generating a rollout
ROLLOUT_BUSY = 8


def _engines(run_dir: Path) -> list[tuple[int, str]]:
    """(pid, url) of the run's engine servers, from their command lines."""
    hf_start = str(run_dir / "hf_start")
    found = []
    for pid, args in command_lines():
        if "titan_rl.engine" in args and hf_start in args:
            found.append((pid, f"http://127.0.0.1:{args[args.index('--port') + 1]}"))
    return sorted(found, key=lambda x: x[1])


def _info(http: httpx.Client, url: str) -> dict:
    try:
        return http.get(f"{url}/get_server_info").json()
    except (httpx.HTTPError, ValueError):
        return {}


def _kill_in_rollout_of_step_2(
    run_dir: Path, engines: int, job: subprocess.Popen, out: dict
) -> None:
    """Kill an engine while it generates on weight version 1: step 2's rollout (step 1's sync
    set version 1; step 2's sync sets version 2 before its parity probe). More sequences in
    flight than ``ROLLOUT_BUSY`` tell the rollout (32 prompts x 8) from the parity probe of
    step 1's sync (2 sequences)."""
    deadline = time.monotonic() + 600
    found: list[tuple[int, str]] = []
    while len(found) < engines:
        assert job.poll() is None and time.monotonic() < deadline, "the engines never started"
        found = _engines(run_dir)
        time.sleep(0.5)
    with httpx.Client(timeout=5) as http:
        while job.poll() is None and time.monotonic() < deadline:
            versions = []
            for pid, url in found:
                info = _info(http, url)
                versions.append(info.get("weight_version"))
                busy = info.get("num_running_reqs", 0) + info.get("num_queued_reqs", 0)
                if info.get("weight_version") == "1" and busy > ROLLOUT_BUSY:
                    os.kill(pid, signal.SIGKILL)
                    out["killed"] = url
                    return
            if any(v not in (None, "0", "1") for v in versions):
                out["missed"] = f"the engines went to versions {versions} first"
                return
            time.sleep(0.001 if "1" in versions else 0.05)


def _run_and_kill(run_dir: Path, base: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
        f"policy.load={base}", f"run.dir={run_dir}", "run.num_steps=3", "run.save_interval=0",
        "run.eval_interval=100", "data.num_eval=16", "train.ppo_steps=1", "sync.check_every=1",
        "engines.retry_timeout_s=300", *extra,
    ]  # fmt: skip
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, text=True)
    out: dict = {}
    engines = 2 if "engines.num_engines=2" in extra else 1
    killer = threading.Thread(target=_kill_in_rollout_of_step_2, args=(run_dir, engines, job, out))
    killer.start()
    try:
        job.wait(timeout=900)
    finally:
        if job.poll() is None:
            job.kill()
        killer.join()
        log.close()
    out["log"] = Path(log.name).read_text()
    return job, out


def _check_steps(run_dir: Path, engines: int) -> list[dict]:
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        # each step's samples come from the weights of the sync before it, however served
        assert r["rollout/weight_version"] == str(r["step"] - 1), r
        assert r["engines/serving"] == engines, r
        # every engine (the restarted one too) scores the probe like the trainer
        assert r["sync/logprob_abs_diff_max"] < 1e-4, r
    assert recs[0]["engines/restarts"] == 0
    assert [r["engines/restarts"] for r in recs[1:]] == [1, 1]
    return recs


def test_one_of_two_engines_killed_the_other_serves_and_it_rejoins(tmp_path, base):
    run_dir = tmp_path / "two"
    job, out = _run_and_kill(run_dir, base, "engines.num_engines=2", "engines.router=true")
    assert "missed" not in out and "killed" in out, out.get("missed", out["log"][-3000:])
    assert job.returncode == 0, out["log"][-6000:]
    # the step ended (on the other engine, or on both once the killed one was resynced);
    # at the end of every step both serve behind the router, scoring the probe like the
    # trainer (the killed one took the weights of step 2's sync, or a resync before it)
    _check_steps(run_dir, engines=2)
