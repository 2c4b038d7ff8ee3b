"""Preemption of ``python -m titan_core.pretrain``: SIGTERM / SIGINT finish the current step,
save it, exit 143 / 130 with one line saying how to resume, and the rerun resumes there;
under torchrun a signal to one rank stops every rank at the same step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.pretrain_runner import FAST, REPO, TINY
from titan_core.checkpoint import latest_iteration
from titan_core.training.metrics import read_metrics

STOPPED = re.compile(
    r"stopped by (SIG\w+) at step (\d+); saved iter_(\d{7}); rerun the same command to resume"
)


def _start(run_dir: Path, nproc: int = 1, *extra: str) -> subprocess.Popen:
    args = ["--config", TINY, *FAST, "train.train_iters=1000", "train.log_interval=1"]
    args += [f"run.dir={run_dir}", *extra]
    launcher = ["-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone"]
    cmd = [sys.executable, *(launcher if nproc > 1 else []), "-m", "titan_core.pretrain", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip


def _wait_for_step(proc: subprocess.Popen, step: int) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if re.match(rf"step +{step}/", line):
            return lines
    raise AssertionError("".join(lines[-40:]))


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return out


def _stopped(out: str, sig: signal.Signals) -> int:
    """The step the one "stopped by" line names, checked against ``sig`` and the iteration."""
    (line,) = [x for x in out.splitlines() if x.startswith("stopped by")]
    name, step, it = STOPPED.fullmatch(line).groups()
    assert name == sig.name and int(it) == int(step)
    return int(step)


@pytest.mark.slow
def test_signal_saves_the_step_and_the_rerun_resumes_there(tmp_path):
    """SIGTERM: the step saved, exit 143; the rerun (the same command) resumes there, and a
    SIGINT (Ctrl-C's signal) to it saves its own step the same way, exit 130. (A resumed run
    that goes on to train_iters: tests/core/test_resume.py.)"""
    proc = _start(tmp_path)
    _wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    step = _stopped(out, signal.SIGTERM)
    assert step >= 2
    assert latest_iteration(tmp_path / "checkpoints") == step
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(1, step + 1))

    proc = _start(tmp_path)
    lines = _wait_for_step(proc, step + 2)
    proc.send_signal(signal.SIGINT)
    out = "".join(lines) + _finish(proc)
    assert f"at step {step}" in out and "resumed from" in out
    assert proc.returncode == 128 + signal.SIGINT, out[-3000:]
    again = _stopped(out, signal.SIGINT)
    assert again >= step + 2
    assert latest_iteration(tmp_path / "checkpoints") == again
    steps = [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")]
    assert steps == list(range(1, again + 1))


def test_save_on_signal_off_exits_without_saving(tmp_path):
    proc = _start(tmp_path, 1, "checkpoint.save_on_signal=false")
    _wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc)
    assert proc.returncode == 143, out[-3000:]
    assert latest_iteration(tmp_path / "checkpoints") is None
    assert "not saved (checkpoint.save_on_signal=false)" in out
    assert "rerun the same command to start over" in out


@pytest.mark.slow
def test_torchrun_ranks_stop_together_when_one_gets_the_signal(tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree (a flag all-reduced each step), so both stop
    after the same step and write one complete checkpoint of it."""
    import psutil

    proc = _start(tmp_path, 2)
    _wait_for_step(proc, 2)
    workers = psutil.Process(proc.pid).children()
    (rank1,) = [w for w in workers if w.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGTERM)
    out = _finish(proc)
    (line,) = [x for x in out.splitlines() if x.startswith("stopped by")]  # rank 0 says it
    name, step, _ = STOPPED.fullmatch(line).groups()
    assert name == "SIGTERM"
    assert latest_iteration(tmp_path / "checkpoints") == int(step)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")][-1] == int(step)
