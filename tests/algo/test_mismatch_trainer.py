"""The trainer's step metrics carry the ``mismatch/*`` record, whatever the switches."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.algo.mismatch_worker import DELTAS
from tests.models.hf_cases import build_hf_model

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a trainer process of its own: ~10-15 s
def test_policy_trainer_records_the_mismatch_every_step(tmp_path):
    build_hf_model("llama").save_pretrained(tmp_path / "hf")
    out = tmp_path / "metrics.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests/algo/mismatch_worker.py"),
         "--model-dir", str(tmp_path / "hf"), "--run-dir", str(tmp_path / "run"),
         "--out", str(out)],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())

    deltas = [d for row in DELTAS for d in row]
    n = len(deltas)
    want = {
        "mismatch/logprob_abs_diff_mean": sum(abs(d) for d in deltas) / n,
        "mismatch/logprob_abs_diff_max": max(abs(d) for d in deltas),
        "mismatch/kl": sum(math.exp(d) - d - 1 for d in deltas) / n,
        "mismatch/ratio_mean": sum(math.exp(d) for d in deltas) / n,
    }
    outside = sum(abs(d) == 1.0 for d in deltas)  # ratio e or 1/e: outside [0.5, 2]
    for name, share in [("off", 0.0), ("mis_icepop", outside / n), ("seq_mis", 9 / n)]:
        for key, value in want.items():
            assert got[name][key] == pytest.approx(value, abs=1e-5), (name, key)
        assert got[name]["mismatch/masked_share"] == pytest.approx(share)
    # one PPO step from the old policy: ratio 1, so the loss is -A * IcePop's weight exp(delta)
    # summed over the tokens MIS keeps and divided by their count (not all 12), per microbatch
    # (train/loss is the mean of the 2 microbatches' shares)
    kept = [(a, d) for a, d in zip(got["advantages"], deltas, strict=True) if abs(d) != 1.0]
    loss = sum(-a * math.exp(d) for a, d in kept) / len(kept) / 2
    assert got["mis_icepop"]["train/loss"] == pytest.approx(loss, abs=1e-5)
    assert got["off"]["train/loss"] == pytest.approx(-sum(got["advantages"]) / n / 2, abs=1e-5)
    # seq_mean_token_mean over the one sequence left (row 2, in the second microbatch): the
    # sequence count is 1, not 4
    row2 = got["advantages"][6:9]
    assert got["seq_mis"]["train/loss"] == pytest.approx(-sum(row2) / 3 / 1 / 2, abs=1e-5)
