"""Damaged checkpoints are named, skipped for the newest good one, and never loaded unsafely;
a save that runs out of space says so and leaves no partial folder (issue 23 item 5)."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
from megatron.core.dist_checkpointing.core import CheckpointingException

from tests.core.pretrain_runner import FAST, TINY, run_pretrain
from titan_core.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    damage,
    latest_iteration,
    save_checkpoint,
)
from titan_core.checkpoint.dist import TRACKER, iteration_dir
from titan_core.training.metrics import read_metrics


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A tiny pretraining run with complete saves at iterations 2 and 4."""
    run = tmp_path_factory.mktemp("ckpt")
    run_pretrain(
        TINY,
        [*FAST, "train.train_iters=4", "checkpoint.save_interval=2", "checkpoint.keep_last=0",
         f"run.dir={run}"],
    )  # fmt: skip
    return run


@pytest.fixture
def run(saved, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved, copy)
    return copy


def _shard(folder: Path) -> Path:
    return sorted(folder.glob("*.distcp"))[0]


def _latest_warning(root: Path) -> tuple[int | None, str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        it = latest_iteration(root)
    return it, " ".join(str(w.message) for w in caught if w.category is CheckpointWarning)


def test_intact_checkpoint_passes(run):
    ck = run / "checkpoints"
    assert damage(iteration_dir(ck, 4)) is None
    assert _latest_warning(ck) == (4, "")


def test_truncated_shard_falls_back_to_the_previous_iteration(run):
    ck = run / "checkpoints"
    shard = _shard(iteration_dir(ck, 4))
    os.truncate(shard, shard.stat().st_size - 10)
    it, warned = _latest_warning(ck)
    assert it == 2
    assert "iteration 4" in warned and shard.name in warned and "truncated" in warned


def test_garbage_common_state_is_named_without_unsafe_advice(run):
    ck = run / "checkpoints"
    common = iteration_dir(ck, 4) / "common.pt"
    common.write_bytes(os.urandom(common.stat().st_size))
    reason = damage(iteration_dir(ck, 4))
    assert reason is not None and "common.pt" in reason
    it, warned = _latest_warning(ck)
    assert it == 2 and "common.pt" in warned
    assert "weights_only=False" not in warned and "weights_only` set to `False" not in warned


def test_missing_shard_and_index(run):
    ck = run / "checkpoints"
    _shard(iteration_dir(ck, 4)).unlink()
    assert "missing" in damage(iteration_dir(ck, 4))
    (iteration_dir(ck, 2) / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError) as e:
        latest_iteration(ck)
    msg = str(e.value)
    assert "iteration 4" in msg and "iteration 2" in msg and ".metadata" in msg


def test_tracker_without_a_number_is_refused(run):
    ck = run / "checkpoints"
    (ck / TRACKER).write_text("\x00\x01garbage")
    with pytest.raises(CheckpointError, match="iteration number"):
        latest_iteration(ck)


def test_resume_goes_on_from_the_last_good_save(run):
    """The user's command: a resume over a damaged newest save warns and continues from
    the previous one, and records each step once."""
    ck = run / "checkpoints"
    shard = _shard(iteration_dir(ck, 4))
    os.truncate(shard, shard.stat().st_size // 2)
    proc = run_pretrain(
        TINY,
        [*FAST, "train.train_iters=5", "checkpoint.save_interval=0", f"run.dir={run}"],
    )
    assert "using iteration 2" in proc.stderr and "truncated" in proc.stderr
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == [1, 2, 3, 4, 5]


def test_a_save_out_of_space_removes_its_partial_folder(tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    root = tmp_path / "checkpoints"

    def full_disk(state, path, *a, **k):
        Path(path, "__0_0.distcp").write_bytes(b"x" * 1000)  # what was written before
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as e:
            raise CheckpointingException("save failed") from e  # as megatron wraps it

    monkeypatch.setattr(dist_checkpointing, "save", full_disk)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(root, 6, [], None, {"step": 6})
    assert "no space left" in str(e.value) and str(iteration_dir(root, 6)) in str(e.value)
    assert not iteration_dir(root, 6).exists()
    assert not (root / TRACKER).exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 200 KiB file system (tmpfs): a checkpoint of the tiny model does not fit."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(mount)],
                          capture_output=True, text=True)  # fmt: skip
    if made.returncode:
        pytest.skip(f"a small tmpfs needs mount (root): {made.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_full_disk_is_said_and_its_partial_folder_removed(tmp_path, small_disk):
    """A file system that fills up during the save: torch's shard writer says only
    "unexpected pos" (no ENOSPC reaches the caller), and the error is a BaseException; the
    command still names the full disk and the folder, and leaves no partial save behind."""
    save = small_disk / "ckpt"
    proc = run_pretrain(
        TINY,
        [*FAST, "train.train_iters=2", "train.lr_warmup_iters=0", f"run.dir={tmp_path / 'run'}",
         f"checkpoint.save={save}"],
        check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    line = next(s for s in proc.stderr.splitlines() if s.startswith("error: saving iteration 2"))
    assert f"to {iteration_dir(save, 2)} failed: no space left on the device" in line, line
    assert "the partial folder was removed" in line
    assert not iteration_dir(save, 2).exists() and not (save / TRACKER).exists()


def test_nothing_loadable_is_one_error_line(run):
    ck = run / "checkpoints"
    for it in (2, 4):
        (iteration_dir(ck, it) / "common.pt").write_bytes(b"not a checkpoint")
    proc = run_pretrain(
        TINY, [*FAST, "train.train_iters=5", f"run.dir={run}"], check=False, timeout=120
    )
    assert proc.returncode == 1
    assert "error: no loadable checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert "iteration 2" in proc.stderr and "iteration 4" in proc.stderr
