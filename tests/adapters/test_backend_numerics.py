"""The adapters' training path is Titan's GRPO update: the same samples, handed as a slime DP
rank's rollout data (rewards normalized per group on the rollout side, old logprobs computed
once before the step), give the parameters ``titan_rl``'s own path gives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.models.hf_cases import build_hf_model

REPO = Path(__file__).resolve().parents[2]


def _run(mode: str, model_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/adapters/backend_worker.py"), "--mode", mode,
         "--model-dir", str(model_dir), "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_adapter_update_equals_titan_grpo_update(tmp_path):
    model_dir = tmp_path / "hf"
    build_hf_model("llama").save_pretrained(model_dir)
    titan = _run("titan", model_dir, tmp_path / "titan.pt")
    adapter = _run("adapter", model_dir, tmp_path / "adapter.pt")
    assert titan["after"].keys() == adapter["after"].keys()
    step = max((titan["after"][k] - titan["before"][k]).abs().max().item() for k in titan["after"])
    assert step > 1e-4, "the update did not move the weights"
    diff = max((titan["after"][k] - adapter["after"][k]).abs().max().item() for k in titan["after"])
    assert diff < 1e-6, f"adapter and titan_rl updates differ by {diff:.3g} (step {step:.3g})"
