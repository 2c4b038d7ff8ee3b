"""Preemption of the GRPO job: SIGTERM / Ctrl-C stop it after the last completed step, saved,
with engines, trainer ranks and Ray gone, exit 143 / 130 and one line saying how to resume;
the rerun resumes there. A ``kill -9`` of the driver leaves nothing in /dev/shm. A signal
while the job pretrains its base stops the pretraining child too, and the rerun trains that
base on."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import titan_rl.base_policy as base_policy
from titan_core.checkpoint import latest_iteration
from titan_core.training.metrics import read_metrics
from titan_rl.config import PolicyConfig

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
SLOW_REWARD = f"{REPO / 'tests/rl/slow_reward.py'}:starts_with_one_slowly"


class Job:
    """``python -m titan_rl.grpo`` (or any command) in its own session, its output read as
    it comes."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            start_new_session=True,
        )  # fmt: skip
        self.lines: list[str] = []

    def wait_for(self, pattern: str) -> str:
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.search(pattern, line):
                return line
        raise AssertionError(f"no {pattern!r} in:\n" + "".join(self.lines[-60:]))

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def finish(self, timeout_s: float = 300) -> str:
        try:
            out, _ = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise
        self.lines.append(out)
        return "".join(self.lines)


def _grpo(run_dir: Path, base: Path, steps: int, *extra: str) -> Job:
    return Job([
        sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
        f"policy.load={base}", f"run.dir={run_dir}", f"run.num_steps={steps}",
        "run.eval_interval=100", "run.save_interval=100", "data.num_eval=16",
        "rollout.prompts_per_step=16", "rollout.n_samples_per_prompt=8",
        "train.micro_batch_size=64", "train.ppo_steps=1", "sync.check_every=0",
        "reward.type=custom", f"reward.custom_path={SLOW_REWARD}", *extra,
    ])  # fmt: skip


def _alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def _left_after(procs: list[psutil.Process], timeout_s: float = 120) -> list[str]:
    """Those of ``procs`` still running once they had ``timeout_s`` to go."""
    deadline = time.monotonic() + timeout_s
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    return [f"{p.pid} {' '.join(p.cmdline())[:100]}" for p in _alive(procs)]


def _shm() -> set[str]:
    return {p.name for p in SHM.glob("torch_*")} if SHM.is_dir() else set()


def _new_shm(before: set[str], timeout_s: float = 120) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while _shm() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    return _shm() - before


def _stop_line(out: str) -> str:
    (line,) = [x for x in out.splitlines() if x.startswith("stopped by")]
    return line


def _reward_steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


@pytest.mark.slow
def test_sigterm_saves_the_last_step_stops_everything_and_the_rerun_resumes(tmp_path, base):
    run_dir, shm_before = tmp_path / "run", _shm()
    job = _grpo(run_dir, base, 20)
    job.wait_for(r"^step +2/20 ")  # the signal lands in step 3's rollout (a slow reward)
    procs = job.descendants()
    assert any("titan_rl.engine" in " ".join(p.cmdline()) for p in procs)
    job.proc.send_signal(signal.SIGTERM)
    out = job.finish()
    assert job.proc.returncode == 143, out[-4000:]
    assert _stop_line(out) == (
        "stopped by SIGTERM at step 2; saved iter_0000002; rerun the same command to resume"
    )
    assert latest_iteration(run_dir / "checkpoints") == 2
    assert _reward_steps(run_dir) == [1, 2]  # step 3 was abandoned before its update
    assert "Traceback" not in out and "was destroyed but it is pending" not in out
    assert _left_after(procs) == [], "processes outlived the job"
    assert _new_shm(shm_before) == set()

    # the rerun resumes at step 2; a kill -9 of its driver leaves no sync bucket behind
    job = _grpo(run_dir, base, 20)
    job.wait_for(r"^step +3/20 ")
    assert any("resumed from" in x and "at step 2" in x for x in job.lines)
    job.proc.kill()
    job.finish()
    assert _reward_steps(run_dir) == [1, 2, 3]
    assert _new_shm(shm_before) == set(), "kill -9 left shared memory in /dev/shm"


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_stops_with_130(tmp_path, base):
    """A terminal's Ctrl-C reaches every process of the group: Ray's were started ignoring
    it, so the job still saves and shuts down in order."""
    run_dir = tmp_path / "run"
    job = _grpo(run_dir, base, 20)
    job.wait_for(r"^step +1/20 ")
    procs = job.descendants()
    os.killpg(job.proc.pid, signal.SIGINT)
    out = job.finish()
    assert job.proc.returncode == 130, out[-4000:]
    assert _stop_line(out) == (
        "stopped by SIGINT at step 1; saved iter_0000001; rerun the same command to resume"
    )
    assert latest_iteration(run_dir / "checkpoints") == 1
    assert "Traceback" not in out
    assert _left_after(procs) == [], "processes outlived the job"


@pytest.mark.slow
def test_sigterm_while_pretraining_the_base_stops_the_child_too(tmp_path):
    load = tmp_path / "base" / "checkpoints"
    job = Job([
        sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
        f"policy.load={load}", f"run.dir={tmp_path / 'run'}",
        f"policy.pretrain_overrides=[train.log_interval=1,run.dir={load.parent}]",
    ])  # fmt: skip
    job.wait_for(r"^step +2/")  # the pretraining child's status line
    (child,) = [p for p in job.descendants() if "titan_core.pretrain" in " ".join(p.cmdline())]
    job.proc.send_signal(signal.SIGTERM)
    out = job.finish()
    assert job.proc.returncode == 143, out[-4000:]
    saved = re.search(r"stopped by SIGTERM at step (\d+); saved iter_\d+", out)
    assert saved, out[-4000:]
    assert latest_iteration(load) == int(saved.group(1))
    assert out.rstrip().splitlines()[-1] == (
        f"stopped by SIGTERM while pretraining the base policy in {load.parent}; "
        "rerun the same command to train it on from its last checkpoint"
    )
    assert _left_after([child]) == []
    assert (load.parent / base_policy.UNFINISHED).exists()


def test_base_whose_pretraining_was_stopped_is_trained_on(tmp_path, monkeypatch, capsys):
    """A stopped (or killed) pretraining leaves its checkpoint and a mark: the next job
    trains that base on instead of taking it as finished."""
    calls: list[Path] = []
    monkeypatch.setattr(base_policy, "latest_iteration", lambda root: 40)
    monkeypatch.setattr(base_policy, "_pretrain", lambda pol, run_dir: calls.append(run_dir))
    run_dir = tmp_path / "base"
    run_dir.mkdir()
    pol = PolicyConfig(
        load=str(run_dir / "checkpoints"),
        pretrain_config=str(REPO / "examples/pretrain_math_base.yaml"),
    )
    base_policy.ensure_base_policy(pol)  # no mark: a finished base, taken as it is
    assert calls == []
    (run_dir / base_policy.UNFINISHED).touch()
    base_policy.ensure_base_policy(pol)
    assert calls == [run_dir]
    assert "stopped at step 40 before it finished: training it on" in capsys.readouterr().out
