"""The real GRPO job (Ray, a Megatron trainer actor, the built-in engine) with its engine
stopped (SIGSTOP) mid-rollout, the way a hung engine looks: it neither answers nor exits.

Stopped for less than ``engines.health_timeout_s`` (step 2's rollout): its supervisor says
which engine has not answered and for how long, and the step goes on once it runs again
(SIGCONT). Stopped for good (step 3's rollout): its supervisor kills it at the timeout and
restarts it, the trainer gives it the current weights, and the run finishes on the current
policy instead of waiting out ``engines.retry_timeout_s`` (900 s by default) and stopping.
The step records say so: ``engines/unanswered_s``, ``engines/hung_restarts``.

Then, in the same job, the restarted engine is killed (-9) in the middle of step 4's
rollout: its supervisor restarts it, the trainer gives it the weights of the last sync
before it serves, and the step finishes on the current policy (a lone engine's kill, in
this job to spare a start-up; tests/rl/test_engine_death_e2e.py kills one of two engines
behind the router)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.procs import command_lines
from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
#: sequences running or waiting on an engine above which it is generating a rollout (32
#: prompts x 8), not scoring the parity probe of a sync (2 sequences)
ROLLOUT_BUSY = 8
HEALTH_TIMEOUT_S = 12.0
#: the short stop: past the supervisor's first warning (5 s, seen by a probe timing out
#: 3 s after it started), short of the timeout
SHORT_STOP_S = 8.0


def _engine(run_dir: Path) -> tuple[int, str] | None:
    """(pid, url) of the run's engine server, from its command line."""
    hf_start = str(run_dir / "hf_start")
    for pid, args in command_lines():
        if "titan_rl.engine" in args and hf_start in args:
            return pid, f"http://127.0.0.1:{args[args.index('--port') + 1]}"
    return None


def _wait_for_rollout(http: httpx.Client, url: str, version: str, job: subprocess.Popen) -> bool:
    """Until the engine generates a rollout on weight ``version`` (False: the job ended or
    the engine went past it first)."""
    while job.poll() is None:
        try:
            info = http.get(f"{url}/get_server_info").json()
        except (httpx.HTTPError, ValueError):
            info = {}
        v = info.get("weight_version")
        if v is not None and int(v) > int(version):
            return False
        if v == version and info.get("num_running_reqs", 0) + info.get("num_queued_reqs", 0) > (
            ROLLOUT_BUSY
        ):
            return True
        time.sleep(0.001 if v == version else 0.05)
    return False


def _stop_in_rollouts(run_dir: Path, job: subprocess.Popen, out: dict) -> None:
    """Step 2's rollout (weight version 1): SIGSTOP for SHORT_STOP_S, then SIGCONT. Step 3's
    (version 2): SIGSTOP, left stopped. Step 4's (version 3): SIGKILL of the engine its
    supervisor restarted."""
    deadline = time.monotonic() + 600
    while (found := _engine(run_dir)) is None:
        if job.poll() is not None or time.monotonic() > deadline:
            return
        time.sleep(0.5)
    pid, url = found
    out["url"] = url
    with httpx.Client(timeout=5) as http:
        if not _wait_for_rollout(http, url, "1", job):
            out["missed"] = "step 2's rollout"
            return
        os.kill(pid, signal.SIGSTOP)
        time.sleep(SHORT_STOP_S)
        os.kill(pid, signal.SIGCONT)
        out["short"] = pid
        if not _wait_for_rollout(http, url, "2", job):
            out["missed"] = "step 3's rollout"
            return
        os.kill(pid, signal.SIGSTOP)
        out["stopped"] = pid
        # the engine its supervisor started in place of the stopped one
        while (found := _engine(run_dir)) is None or found[0] == pid:
            if job.poll() is not None or time.monotonic() > deadline:
                out["missed"] = "the restart of the stopped engine"
                return
            time.sleep(0.2)
        restarted, url = found
        if not _wait_for_rollout(http, url, "3", job):
            out["missed"] = "step 4's rollout"
            return
        os.kill(restarted, signal.SIGKILL)
        out["killed"] = restarted


def run_with_stops(run_dir: Path, base: Path) -> tuple[subprocess.Popen, dict]:
    cmd = [
        sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
        f"policy.load={base}", f"run.dir={run_dir}", "run.num_steps=5", "run.save_interval=0",
        "run.eval_interval=100", "data.num_eval=16", "train.ppo_steps=1", "sync.check_every=1",
        f"engines.health_timeout_s={HEALTH_TIMEOUT_S:g}", "engines.retry_timeout_s=300",
    ]  # fmt: skip
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115
    env = {**os.environ, "RAY_raylet_start_wait_time_s": "240"}  # loaded CI machines start slowly
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, text=True, env=env)
    out: dict = {}
    stopper = threading.Thread(target=_stop_in_rollouts, args=(run_dir, job, out))
    stopper.start()
    try:
        job.wait(timeout=600)
    finally:
        if job.poll() is None:
            job.kill()
        stopper.join()
        log.close()
        if "stopped" in out and psutil.pid_exists(out["stopped"]):
            os.kill(out["stopped"], signal.SIGKILL)  # only if the run left it (a failure)
    out["log"] = Path(log.name).read_text()
    return job, out


def test_a_stopped_engine_is_waited_for_then_killed_and_restarted(tmp_path, base):
    run_dir = tmp_path / "hang"
    job, out = run_with_stops(run_dir, base)
    assert "missed" not in out and "killed" in out, out.get("missed", out["log"][-3000:])
    assert job.returncode == 0, out["log"][-6000:]
    log, url = out["log"], out["url"]
    # the short stop: said, naming the engine and how long, then its answer again
    assert f"{url} (pid {out['short']}) has not answered its health probe for" in log, log[-6000:]
    assert f"{url} answers its health probe again after" in log, log[-6000:]
    # the stop for good: killed at the timeout, restarted, given the current weights
    assert "killing it (SIGKILL of its process group) to restart it" in log, log[-6000:]
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5]
    for r in recs:
        # each step's samples come from the weights of the sync before it, however served
        assert r["rollout/weight_version"] == str(r["step"] - 1), r
        assert r["engines/serving"] == 1, r
        # every engine (the restarted ones too) scores the probe like the trainer
        assert r["sync/logprob_abs_diff_max"] < 1e-4, r
    assert [r["engines/restarts"] for r in recs] == [0, 0, 1, 2, 2]
    assert [r["engines/hung_restarts"] for r in recs] == [0, 0, 1, 1, 1]
    step2, step3, step4 = recs[1], recs[2], recs[3]
    assert SHORT_STOP_S - 1 <= step2["engines/unanswered_s"] < HEALTH_TIMEOUT_S, step2
    assert step3["engines/unanswered_s"] >= HEALTH_TIMEOUT_S, step3
    assert step3["engines/resyncs"] == 1 and step3["resync/logprob_abs_diff_max"] < 1e-4, step3
    assert not psutil.pid_exists(out["stopped"])
    # the kill -9: the rollout could not end without the lone engine, so the trainer gave
    # the restarted one the step-3 weights mid-step
    assert step4["engines/resyncs"] == 1, step4
    assert step4["resync/logprob_abs_diff_max"] < 1e-4, step4
