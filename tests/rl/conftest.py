"""Runs shared by the GRPO end-to-end tests of this folder."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class MathToolRun:
    """``examples/math_tool.yaml`` end to end, shortened: ``base`` is the tool-mixed base's run
    folder, which the job pretrained through ``policy.pretrain_config``; ``run_dir`` the GRPO
    run's."""

    base: Path
    run_dir: Path
    proc: subprocess.CompletedProcess


@pytest.fixture(scope="session")
def math_tool_run(tmp_path_factory: pytest.TempPathFactory) -> MathToolRun:
    """The math_tool example's job, run once: test_math_tool_e2e checks its records, and
    test_tool_faults_e2e starts its own job from the base it pretrained."""
    root = tmp_path_factory.mktemp("math_tool")
    base, run_dir = root / "base", root / "grpo"
    # a short base: half the rows tool transcripts, so sampling calls the calculator
    recipe = (
        f"[run.dir={base}, train.train_iters=120, train.lr_warmup_iters=20, "
        "train.stop_at_eval_accuracy=null, train.eval_interval=120, data.tool_fraction=0.5, "
        "data.num_samples=8000]"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", "--config", str(REPO / "examples/math_tool.yaml"),
         f"policy.load={base / 'checkpoints'}", f"policy.pretrain_overrides={recipe}",
         f"run.dir={run_dir}", "run.num_steps=3", "run.eval_interval=3", "run.save_interval=0",
         "data.num_eval=16", "rollout.prompts_per_step=8", "rollout.n_samples_per_prompt=4",
         "train.micro_batch_size=32", "train.ppo_steps=1"],
        capture_output=True, text=True, cwd=REPO, timeout=600,
    )  # fmt: skip
    return MathToolRun(base, run_dir, proc)
