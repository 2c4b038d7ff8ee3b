"""Nothing non-finite reaches the weights or the disk: the RL trainer and the pretraining
loop refuse a NaN reward, loss or gradient before the optimizer step (naming the step and
what was not finite), and a model with a NaN parameter is neither synced nor saved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.hf_cases import build_hf_model

pytestmark = pytest.mark.slow  # ~20-30 s each: a trainer process of its own
REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, mode: str, *extra: str) -> dict:
    out = tmp_path / f"{mode}.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/rl/nonfinite_worker.py"), "--mode", mode,
         "--run-dir", str(tmp_path / f"run_{mode}"), "--out", str(out), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_rl_trainer_refuses_nonfinite_rewards_gradients_and_parameters(tmp_path):
    model_dir = tmp_path / "hf"
    build_hf_model("llama").save_pretrained(model_dir)
    got = _run(tmp_path, "rl", "--model-dir", str(model_dir))

    assert got["nan_reward"].startswith("step 3: rewards: 1 of 4 samples")
    assert "reward.custom_path" in got["nan_reward"] and got["nan_reward_unchanged"]

    assert got["nan_grad"].startswith("step 4, PPO step 1 of 2: non-finite gradients (NaN")
    assert "optimizer step was not applied" in got["nan_grad"] and got["nan_grad_unchanged"]

    assert got["healthy_moved"] and got["healthy_loss"] == got["healthy_loss"]  # not NaN

    assert got["nan_param"].startswith("step 6, PPO step 1 of 2: non-finite loss and gradients")
    assert got["nan_param_unchanged"]
    assert got["save"].startswith("step 6: checkpoint: refused: the model has non-finite")
    assert got["sync"].startswith("step 6: weight sync: refused")
    assert got["checkpoints"] == []


def test_pretraining_refuses_a_nan_loss_before_the_step_and_saves_nothing(tmp_path):
    got = _run(tmp_path, "pretrain")
    assert got["train"].startswith("step 1: non-finite loss and gradients (NaN or inf)")
    assert "train.lr" in got["train"]
    assert got["save"].startswith("step 1: checkpoint refused: the model has non-finite")
    assert got["checkpoints"] == []
