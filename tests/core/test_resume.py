"""Resume: a run stopped and started again continues exactly; checkpoints reshard."""

from __future__ import annotations

import shutil

import pytest

from tests.core.pretrain_runner import FAST, TINY, losses, run_pretrain
from titan_core.checkpoint.dist import TRACKER, latest_iteration
from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_resume_equals_straight_run(tmp_path):
    """A run stopped at step 5 and started again continues exactly as if never stopped, from
    its last complete checkpoint: a save killed before the tracker update leaves a folder
    that resume ignores, and the steps recorded after the checkpoint are recorded once."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    run_pretrain(TINY, [*FAST, "train.train_iters=10", f"run.dir={straight}"])
    # The first half stops at step 5 (and saves); the second run resumes from it.
    run_pretrain(
        TINY,
        [*FAST, "train.train_iters=5", "train.lr_decay_iters=10", f"run.dir={split}"],
    )
    ckpt = split / "checkpoints"
    assert latest_iteration(ckpt) == 5
    # Simulate a kill during the save of step 7: its folder exists, the tracker still says 5.
    shutil.copytree(ckpt / "iter_0000005", ckpt / "iter_0000007")
    for f in (ckpt / "iter_0000007").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:10])  # torn shard files
    assert (ckpt / TRACKER).read_text().strip() == "5"
    # ... after steps 6 and 7 were recorded (and the kill tore a line)
    with open(split / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 6, "loss": 1.0}\n{"step": 7, "loss": 1.0}\n{"step": 8, "lo')
    proc = run_pretrain(
        TINY, [*FAST, "train.train_iters=10", "train.lr_decay_iters=10", f"run.dir={split}"]
    )
    assert "resumed from" in proc.stdout and "at step 5" in proc.stdout
    assert latest_iteration(ckpt) == 10 and (ckpt / "iter_0000010").is_dir()
    # the repeated steps are recorded once, by the run that resumed
    steps = [r["step"] for r in read_metrics(split / "metrics.jsonl")]
    assert steps == list(range(1, 11))
    assert losses(split) == pytest.approx(losses(straight), rel=1e-5)


def test_save_at_tp2_resume_at_tp1(tmp_path):
    straight, resharded = tmp_path / "straight", tmp_path / "resharded"
    common = [*FAST, "train.lr_decay_iters=6", "parallel.tensor_model_parallel_size=2"]
    run_pretrain(TINY, [*common, "train.train_iters=6", f"run.dir={straight}"], nproc=2)
    run_pretrain(TINY, [*common, "train.train_iters=3", f"run.dir={resharded}"], nproc=2)
    proc = run_pretrain(
        TINY,
        [*FAST, "train.lr_decay_iters=6", "train.train_iters=6", f"run.dir={resharded}",
         "parallel.tensor_model_parallel_size=1"],
    )  # fmt: skip
    assert "at step 3" in proc.stdout
    assert losses(resharded) == pytest.approx(losses(straight), rel=1e-4)


def test_distributed_optimizer_resumes_exactly_at_dp2_and_dp1(tmp_path):
    """The distributed optimizer over torch's Adam (no TE on CPU) saved at DP=2 resumes as
    if never stopped, at DP=2 and resharded to DP=1 (see ``load_optimizer_state``)."""
    straight, split, split_dp1 = tmp_path / "straight", tmp_path / "split", tmp_path / "dp1"
    common = [*FAST, "train.lr_decay_iters=6", "parallel.use_distributed_optimizer=true"]
    run_pretrain(TINY, [*common, "train.train_iters=6", f"run.dir={straight}"], nproc=2)
    run_pretrain(TINY, [*common, "train.train_iters=3", f"run.dir={split}"], nproc=2)
    shutil.copytree(split, split_dp1)
    proc = run_pretrain(TINY, [*common, "train.train_iters=6", f"run.dir={split}"], nproc=2)
    assert "at step 3" in proc.stdout
    assert losses(split) == pytest.approx(losses(straight), rel=1e-5)
    proc = run_pretrain(TINY, [*common, "train.train_iters=6", f"run.dir={split_dp1}"])
    assert "at step 3" in proc.stdout
    assert losses(split_dp1) == pytest.approx(losses(straight), rel=1e-4)
