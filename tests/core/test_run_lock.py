"""One job per run directory (titan_core.run_lock): a second job stops naming the holder; a
holder killed with -9 leaves nothing that blocks the next one."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.pretrain_runner import FAST, REPO, TINY
from titan_core.config import ConfigError
from titan_core.run_lock import LOCK_NAME, RunDirLockedError, RunLock, lock_for_rank, read_holder

#: holds the lock on argv[1] until its stdin closes (or it is killed)
HOLDER = """
import sys
from titan_core.run_lock import RunLock
with RunLock(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.read()
"""


class Holder:
    """A process holding the lock of ``run_dir`` (a context manager: it is killed on exit)."""

    def __init__(self, run_dir: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(run_dir)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, cwd=REPO,
        )  # fmt: skip
        assert self.proc.stdout.readline() == "held\n"

    def __enter__(self) -> subprocess.Popen:
        return self.proc

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.communicate()


def test_a_second_process_is_refused_naming_the_holder(tmp_path):
    with Holder(tmp_path) as holder, pytest.raises(RunDirLockedError) as e:
        RunLock(tmp_path).acquire()
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)  # exit 2 where config errors do
    assert f"run.dir {tmp_path} is in use by pid {holder.pid} on host {socket.gethostname()}" in msg
    assert "choose another run.dir" in msg and "stop that job" in msg
    assert "\n" not in msg  # one line, though the holder's command has several


def test_kill_9_of_the_holder_frees_the_lock(tmp_path):
    with Holder(tmp_path) as holder:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        assert read_holder(tmp_path / LOCK_NAME).pid == holder.pid  # its record is left behind
        with RunLock(tmp_path) as lock:  # ... and taken over
            assert lock.held
            assert read_holder(tmp_path / LOCK_NAME).pid == os.getpid()


def test_release_empties_the_record_and_lets_the_next_job_in(tmp_path):
    run_dir = tmp_path / "new" / "run"  # created
    with RunLock(run_dir):
        rec = read_holder(run_dir / LOCK_NAME)
        assert (rec.pid, rec.host) == (os.getpid(), socket.gethostname())
        with pytest.raises(RunDirLockedError, match=f"pid {os.getpid()} "):
            RunLock(run_dir).acquire()  # another open file: refused even in the same process
    assert (run_dir / LOCK_NAME).read_text() == ""
    with RunLock(run_dir) as again:
        assert again.held
    assert not again.held


def test_a_holder_without_a_record_is_still_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text("")
    with open(tmp_path / LOCK_NAME) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # held, as by a job that wrote nothing yet
        with pytest.raises(RunDirLockedError, match="another process .*records no holder"):
            RunLock(tmp_path).acquire()


def test_a_run_dir_that_cannot_be_created_is_named(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("a file where a folder must be")
    with pytest.raises(ConfigError, match=f"run.dir {blocker / 'run'} is not a writable folder"):
        RunLock(blocker / "run").acquire()


def test_only_rank_0_takes_the_lock(tmp_path):
    with lock_for_rank(tmp_path / "a", 1):
        assert not (tmp_path / "a" / LOCK_NAME).exists()
    with lock_for_rank(tmp_path / "b", 0), pytest.raises(RunDirLockedError):
        RunLock(tmp_path / "b").acquire()


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, cwd=REPO, env=env,
        timeout=300,
    )  # fmt: skip


def test_pretrain_on_a_run_dir_in_use_exits_2_naming_the_holder(tmp_path):
    with Holder(tmp_path) as holder:
        proc = _cli(
            "titan_core.pretrain", "--config", TINY, *FAST, "train.train_iters=2",
            f"run.dir={tmp_path}",
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: run.dir {tmp_path} is in use by pid {holder.pid} on host ")
    assert not (tmp_path / "metrics.jsonl").exists()


def _grpo(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """``python -m titan_rl.grpo ARGS``, in this process: its exit code and stderr."""
    from titan_rl.grpo import main

    code = main(list(args))
    return code, capsys.readouterr().err


def test_grpo_on_a_run_dir_in_use_exits_2_before_ray_starts(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["--config", str(REPO / "examples/math.yaml"), f"run.dir={run_dir}",
            f"policy.load={tmp_path / 'base' / 'checkpoints'}"]  # fmt: skip
    with Holder(run_dir) as holder:
        code, err = _grpo(capsys, *args)
    assert code == 2, err[-3000:]
    assert f"error: run.dir {run_dir} is in use by pid {holder.pid} on host " in err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # nothing else written


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_grpo_refuses_a_base_in_its_own_checkpoints_folder(tmp_path, capsys, dry_run):
    """The base would be pretrained in the run.dir the job holds: refused before anything."""
    run_dir = tmp_path / "run"
    code, err = _grpo(
        capsys, "--config", str(REPO / "examples/math.yaml"), f"run.dir={run_dir}",
        f"policy.load={run_dir / 'checkpoints'}", *(["--dry-run"] if dry_run else []),
    )  # fmt: skip
    assert code == 2, err[-3000:]
    assert f"policy.load {run_dir / 'checkpoints'} is this run's own checkpoints folder" in err
    assert not run_dir.exists()


@pytest.mark.slow
def test_the_base_pretrained_by_a_grpo_job_takes_its_own_lock(tmp_path):
    """The GRPO driver holds its run.dir while its base pretrains in a folder of its own (a
    sub-folder here): the child takes that folder's lock. Pretraining into the driver's own
    run.dir would be refused, which is why grpo rejects that layout up front."""
    from titan_rl.base_policy import _pretrain
    from titan_rl.config import PolicyConfig

    run_dir = tmp_path / "run"
    pol = PolicyConfig(
        load=str(run_dir / "base" / "checkpoints"), pretrain_config=TINY,
        pretrain_overrides=[*FAST, "train.train_iters=2", "checkpoint.save_interval=1"],
    )  # fmt: skip
    with RunLock(run_dir):  # as python -m titan_rl.grpo holds it
        _pretrain(pol, run_dir / "base")
        assert (run_dir / "base" / "checkpoints").is_dir()
        with pytest.raises(subprocess.CalledProcessError) as e:
            _pretrain(pol, run_dir)
    assert e.value.returncode == 2
