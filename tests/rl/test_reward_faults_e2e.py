"""The real GRPO job (Ray, a Megatron trainer actor, the built-in engine) with a custom
reward that returns NaN, a ``correct`` of "False", 1e39 (inf in float32), or hangs: an
invalid reward stops the run naming reward.custom_path, the value and the sample before
anything is saved, and so do rewards that all time out under reward.on_timeouts=stop; with
reward.on_invalid=drop and reward.timeout_s the run goes on, counting both, and every step
finishes."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.training.metrics import read_metrics

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
REWARD = REPO / "tests/rl/fault_reward.py"


def _grpo(run_dir: Path, base: Path, fn: str, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math.yaml"),
         f"policy.load={base}", f"run.dir={run_dir}", "run.num_steps=2", "run.save_interval=1",
         "run.eval_interval=100", "data.num_eval=16", "rollout.prompts_per_step=16",
         "train.micro_batch_size=64", "train.ppo_steps=1", "sync.check_every=100",
         "reward.type=custom", f"reward.custom_path={REWARD}:{fn}", *extra],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("fn", "extra", "needles"),
    [
        ("nan_sometimes", [], ["returned nan", "reward.on_invalid=drop"]),
        # bool("False") is True: rollout/accuracy read 1.0 at reward 0.5
        ("false_as_string", [], ["returned 'correct': 'False' (str)", "reward.on_invalid=drop"]),
        # every call timed out: each replaced worker re-imported the driver (~2 s each)
        (
            "always_hang",
            ["reward.timeout_s=0.2", "reward.on_timeouts=stop"],
            # the base's evaluation (step 0) is the first to score
            ["evaluation: 16 of 16 reward calls", "reward.timeout_s=0.2", "on_timeouts=stop"],
        ),
    ],
    ids=["nan", "correct_as_string", "all_time_out"],
)
def test_a_bad_reward_stops_the_run_naming_the_key_and_saves_nothing(
    tmp_path, base, fn, extra, needles
):
    run_dir = tmp_path / fn
    proc = _grpo(run_dir, base, fn, *extra)
    assert proc.returncode != 0, proc.stdout[-3000:]
    err = proc.stderr[-6000:]
    assert f"reward.custom_path {REWARD}:{fn}" in err, err
    for needle in needles:
        assert needle in err, err
    assert not list((run_dir / "checkpoints").glob("iter_*"))
    assert not [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_dropped_and_timed_out_rewards_are_counted_and_the_run_goes_on(tmp_path, base):
    run_dir = tmp_path / "drop"
    # NaN and 1e39 (inf in float32: it used to pass, and stop the trainer as a NaN loss)
    proc = _grpo(run_dir, base, "invalid_and_hang", "reward.on_invalid=drop", "reward.timeout_s=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    recs = [r for r in read_metrics(run_dir / "metrics.jsonl") if "reward/mean" in r]
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["reward/invalid"] >= 1 and r["reward/timeouts"] >= 1, r
        assert math.isfinite(r["reward/mean"]) and math.isfinite(r["train/loss"]), r
    assert "reward timeouts" in proc.stdout
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
