"""The MoE load metric (tokens per expert max/mean per layer) against hand counts, the
aux-loss-free expert bias balancing a skewed stream, and the pretraining loop applying the
bias each step and writing the metric to metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core.training.metrics import read_metrics
from titan_core.training.moe_load import load_imbalance

WORKER = str(Path(__file__).with_name("moe_worker.py"))
EXPERTS, TOPK = 8, 2


def _worker(tmp_path: Path, mode: str, *args: str, nproc: int = 1) -> dict:
    out = tmp_path / f"{mode}.json"
    launch = (
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--standalone"]
        if nproc > 1
        else [sys.executable]
    )  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(
        [*launch, WORKER, "--mode", mode, "--out", str(out), *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_load_imbalance_is_max_over_mean():
    counts = torch.tensor([[4, 0, 2, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert load_imbalance(counts).tolist() == [2.0, 1.0, 0.0]


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """One process: the hand-count layers, then the balancing run."""
    return _worker(tmp_path_factory.mktemp("single"), "single", "--steps", "25", "--rate", "0.02")


def test_counts_equal_a_hand_count(single):
    out = single["count"]
    plain = out["plain"]
    assert plain["tracked"] == plain["hand"]  # evaluation forward (no grad) not counted
    assert sum(plain["hand"]) == 24 * 2 * TOPK
    ratio = max(plain["hand"]) / (sum(plain["hand"]) / EXPERTS)
    assert plain["record"] == {
        "moe/load_imbalance_layer0": pytest.approx(ratio),
        "moe/load_imbalance_max": pytest.approx(ratio),
    }
    # capacity factor 1, padded to capacity: an expert's load is the tokens it keeps,
    # min(routed, capacity), not the padded slots
    capped = out["capacity"]
    assert capped["tracked"] == capped["hand"]
    assert sum(capped["hand"]) < sum(plain["hand"])  # something was dropped


def test_expert_parallel_counts_all_ranks_tokens(tmp_path):
    """EP=2: each rank routes its own tokens; the metric is the ratio over both ranks."""
    out = _worker(tmp_path, "count_ep", nproc=2)
    assert sum(out["local"]) == 32 * 2 * TOPK  # this rank's tokens only
    assert sum(out["hand"]) == 2 * 32 * 2 * TOPK
    assert out["record"]["moe/load_imbalance_layer0"] == pytest.approx(out["hand_ratio"])


def test_expert_bias_balances_a_skewed_stream(single):
    ratios = single["balance"]["ratios"]
    first, late = ratios[0], sum(ratios[-5:]) / 5
    assert first > 2.5  # the skew sends most tokens to the favoured experts
    assert late < 0.75 * first


@pytest.mark.slow
def test_pretrain_loop_moves_the_bias_each_step_and_logs_the_load(tmp_path):
    rate = 0.01
    out = _worker(tmp_path, "trainer", "--run-dir", str(tmp_path / "run"), "--rate", str(rate))
    biases = torch.tensor(out["biases"])  # [step, router, expert]
    assert biases.shape == (3, out["num_routers"], EXPERTS) and out["num_routers"] == 2
    steps = torch.diff(torch.cat([torch.zeros_like(biases[:1]), biases]), dim=0) / rate
    # one sign update per step: every expert moves by exactly -rate, 0 or +rate
    assert torch.allclose(steps, steps.round(), atol=1e-4)
    assert steps.round().abs().max() == 1
    assert (steps.round().abs().sum(dim=-1) > 0).all()  # every router moved every step
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        layers = [r["moe/load_imbalance_layer0"], r["moe/load_imbalance_layer1"]]
        assert all(1.0 <= x <= EXPERTS / TOPK for x in layers)
        assert r["moe/load_imbalance_max"] == max(layers)
