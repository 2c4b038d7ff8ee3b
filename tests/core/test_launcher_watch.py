"""Workers stop when their launcher dies (titan_core.launcher_watch): a ``kill -9`` of the
parent, then of a real torchrun agent, leaves no worker training on."""

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

from tests.core.pretrain_runner import FAST, REPO, TINY
from titan_core.checkpoint import latest_iteration
from titan_core.launcher_watch import GRACE_S, launched_by_torchrun
from titan_core.run_lock import RunLock

#: a worker: watches its launcher, then "trains" until its stop path (a StopSignals, as
#: pretraining's) or, with argv[2] == "ignore", never (SIGTERM ignored: a hung collective)
WORKER = """
import signal, sys, time
from titan_core.launcher_watch import watch_launcher
from titan_core.signals import StopSignals
with StopSignals() as stop:
    if sys.argv[2] == "ignore":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watch_launcher(poll_s=0.2, grace_s=float(sys.argv[1]))
    print("watching", flush=True)
    while stop.requested is None:
        time.sleep(0.05)
print(f"worker: stopped by {stop.name}", file=sys.stderr, flush=True)
sys.exit(stop.exit_code)
"""

#: a launcher: starts the worker (its output to the files given) and waits
LAUNCHER = """
import subprocess, sys
out, err = open(sys.argv[1], "w"), open(sys.argv[2], "w")
w = subprocess.Popen([sys.executable, "-c", sys.argv[3], *sys.argv[4:]], stdout=out, stderr=err)
print(w.pid, flush=True)
w.wait()
"""


def _gone(pid: int) -> bool:
    """Exited (an orphan's zombie, which a container's init may never reap, counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> float:
    """Seconds until every pid exited; fails after ``timeout_s``."""
    t0 = time.monotonic()
    while not all(_gone(p) for p in pids):
        assert time.monotonic() - t0 < timeout_s, f"still running after {timeout_s} s: {pids}"
        time.sleep(0.1)
    return time.monotonic() - t0


def _wait_for(path: Path, pattern: str, timeout_s: float = 120) -> None:
    """Until a line of ``path`` matches ``pattern``."""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, path.read_text() if path.exists() else "", re.M):
        assert time.monotonic() < deadline, f"no {pattern!r} in {path}"
        time.sleep(0.1)


@pytest.mark.parametrize("env", [{"TORCHELASTIC_RUN_ID": "x"}, {"LOCAL_RANK": "0"}, {}])
def test_launched_by_torchrun(env):
    assert launched_by_torchrun(env) == bool(env)


@pytest.mark.parametrize(
    "mode, said",
    [("stop", "worker: stopped by SIGTERM"), ("ignore", "still running 1 s after")],
    ids=["stop-path", "stop-path-stuck"],
)
def test_kill_9_of_the_launcher_stops_the_worker(tmp_path, mode, said):
    out, err = tmp_path / "out", tmp_path / "err"
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(out), str(err), WORKER, "1", mode],
        stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    worker = int(launcher.stdout.readline())
    try:
        _wait_for(out, "^watching$")
        launcher.kill()
        launcher.wait()
        _wait_gone([worker], timeout_s=15)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
    text = err.read_text()
    assert f"the launcher (pid {launcher.pid}) of this worker (pid {worker}) is gone" in text
    assert said in text


@pytest.mark.slow
def test_kill_9_of_torchrun_stops_its_workers_and_frees_the_run_dir(tmp_path):
    """The real case: both workers of ``torchrun --nproc-per-node 2`` stop (saving their
    step) within seconds of their agent's kill -9, and a second job meanwhile is refused."""
    run_dir, log = tmp_path / "run", tmp_path / "log"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone",
        "-m", "titan_core.pretrain", "--config", TINY, *FAST, "train.train_iters=1000",
        "train.log_interval=1", f"run.dir={run_dir}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(log, "w") as f:
        agent = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True
        )
    workers: list[int] = []
    try:
        _wait_for(log, r"^step +2/", timeout_s=300)
        workers = [p.pid for p in psutil.Process(agent.pid).children()]
        rank0 = [p for p in workers if psutil.Process(p).environ().get("RANK") == "0"]
        assert len(workers) == 2 and len(rank0) == 1

        second = subprocess.run(
            [sys.executable, "-m", "titan_core.pretrain", "--config", TINY, *FAST,
             f"run.dir={run_dir}"],
            capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
        )  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert f"is in use by pid {rank0[0]} on host " in second.stderr

        agent.kill()
        agent.wait()
        # a bound that tells stopping from training on (1000 steps), not a speed target: the
        # stop path is a poll, a step and a save; the fallback exit comes at GRACE_S
        took = _wait_gone(workers, timeout_s=GRACE_S + 30)
        print(f"workers gone {took:.1f} s after the agent's kill -9")
    finally:
        for p in workers:
            if not _gone(p):
                os.kill(p, signal.SIGKILL)
    text = log.read_text()
    # a worker saw it; the stop is agreed over the ranks, so with steps shorter than the
    # watch's poll the other may stop (and save) before its own poll sees the launcher gone
    assert text.count("of this worker") >= 1, text[-3000:]
    saved = re.search(r"stopped by SIGTERM at step (\d+); saved iter_\d+", text)
    assert saved, text[-3000:]
    assert latest_iteration(run_dir / "checkpoints") == int(saved.group(1))
    with RunLock(run_dir) as lock:  # a restart may take the run dir
        assert lock.held


#: a worker that forks a child from its main thread (as megatron's checkpoint writer is),
#: then waits to be killed
FORKER = """
import multiprocessing, time
from titan_core.launcher_watch import tie_forks
tie_forks()
child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
child.start()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_forked_child_dies_with_its_killed_worker():
    """A worker killed outright (the OOM killer) leaves no forked child behind holding its
    sockets open (peers on other nodes would wait on them in their collectives)."""
    worker = subprocess.Popen(
        [sys.executable, "-c", FORKER], stdout=subprocess.PIPE, text=True, cwd=REPO,
        start_new_session=True,
    )  # fmt: skip
    child = int(worker.stdout.readline())
    try:
        worker.kill()
        worker.wait()
        _wait_gone([child], timeout_s=15)
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
