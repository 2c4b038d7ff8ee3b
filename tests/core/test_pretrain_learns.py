"""The demo as a user runs it: the loss clearly falls; metrics.jsonl and checkpoints appear."""

from __future__ import annotations

import pytest

from tests.core.pretrain_runner import TINY, run_pretrain
from titan_core.checkpoint.dist import latest_iteration
from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow


def test_tiny_gpt_learns_arithmetic(tmp_path):
    proc = run_pretrain(
        TINY,
        [f"run.dir={tmp_path}", "train.train_iters=60", "checkpoint.save_interval=30",
         "data.num_samples=20000"],
    )  # fmt: skip
    assert "step    60/60" in proc.stdout
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 61))
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(records[0])
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-5:]) / 5
    assert first > 5.0  # uniform over the padded vocabulary: ln(384) = 5.95
    assert last < 2.6, f"loss fell only from {first:.2f} to {last:.2f}"
    assert latest_iteration(tmp_path / "checkpoints") == 60
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("iter_*")) == [
        "iter_0000030", "iter_0000060",
    ]  # fmt: skip
