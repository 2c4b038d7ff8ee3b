"""With one update per batch the old logprobs are the update forward's own (the separate
no-grad forward is skipped, ``titan_rl.trainer.policy.old_logprobs_forward_reason``): the
same steps as with ``algo.recompute_old_logprobs=true`` (today's separate forward), bit for
bit, and that forward really is skipped; where the old logprobs are needed before the update
(KL in the reward, MIS) it is not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.models.hf_cases import build_hf_model
from tests.rl.old_logprobs_worker import CASES, SHORTCUT_CASES
from titan_core.config import load_config
from titan_rl.config import GRPOConfig
from titan_rl.trainer.batch import RLBatch
from titan_rl.trainer.policy import old_logprobs_forward_reason

REPO = Path(__file__).resolve().parents[2]


def _run_worker(tmp: Path, model_dir: Path, recompute: bool, nproc: int, *extra: str) -> list:
    launch = [sys.executable]
    if nproc > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    out = tmp / f"out{int(recompute)}"
    env = {k: v for k, v in os.environ.items() if k != "TITAN_CONFIG"}
    proc = subprocess.run(
        [*launch, str(REPO / "tests/rl/old_logprobs_worker.py"), "--model-dir", str(model_dir),
         "--run-dir", str(tmp / f"run{int(recompute)}"), "--out", str(out),
         "--recompute", str(int(recompute)), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**env, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nproc)]


@pytest.mark.slow  # two trainer runs (one or two processes each): ~30-60 s
@pytest.mark.parametrize(
    ("nproc", "extra"),
    [
        (1, ()),  # 4 microbatches, sorted by length and cut
        (2, ("--pp", "2")),
        (2, ()),  # DP 2
        # routing replay, its agreement counted in the update's forward; the first layer's
        # routers run again in the backward (activation recompute), counted once
        (1, ("--moe", "--recompute-layers", "1")),
    ],
    ids=["mb4", "pp2", "dp2", "moe_replay_recompute"],
)
def test_update_forward_as_old_policy_gives_the_recomputed_steps(tmp_path, nproc, extra):
    build_hf_model("qwen3_moe" if "--moe" in extra else "llama").save_pretrained(tmp_path / "hf")
    short = _run_worker(tmp_path, tmp_path / "hf", False, nproc, *extra)
    full = _run_worker(tmp_path, tmp_path / "hf", True, nproc, *extra)
    for rank_short, rank_full in zip(short, full, strict=True):
        for name, _ in CASES:
            s, f = rank_short[name], rank_full[name]
            assert f["reason"] == "algo.recompute_old_logprobs=true", name
            # the old policy's forward, the reference's (algo.use_kl_loss), the update
            assert f["runs"] == [("policy", True), ("reference", True), ("policy", False)]
            if name in SHORTCUT_CASES:  # no forward of the old policy of its own
                assert s["reason"] is None, name
                assert s["runs"] == [("reference", True), ("policy", False)], name
            else:  # the old logprobs are needed before the update: today's path
                assert s["reason"] is not None, name
                assert s["runs"] == f["runs"], name
            # every train/* and mismatch/* value, bit for bit (and no key more or less)
            assert s["metrics"] == f["metrics"], name
            assert any(k.startswith("mismatch/") for k in s["metrics"]), name
            for a, b in zip(s["grads"], f["grads"], strict=True):
                assert torch.equal(a, b), name
            for a, b in zip(s["params"], f["params"], strict=True):
                assert torch.equal(a, b), name
        if "train/loss" not in rank_short["tis"]["metrics"]:
            continue
        # metrics reach every rank; the update changed something; the cases did what they say
        assert any(g.abs().max() > 0 for g in rank_short["tis"]["grads"])
        assert rank_short["tis"]["metrics"]["train/ratio_mean"] == 1.0
        assert rank_short["tis"]["metrics"]["train/tis_clipfrac"] > 0
        assert rank_short["icepop"]["metrics"]["mismatch/masked_share"] > 0
        assert rank_short["mis"]["metrics"]["mismatch/masked_share"] > 0
        if "--moe" in extra:  # random routings: the trainer's router agrees with some
            assert 0 < rank_short["tis"]["metrics"]["mismatch/routing_agreement"] < 1


def _rows(old: bool = False) -> RLBatch:
    mask = torch.ones(2, 3)
    return RLBatch(
        torch.ones(2, 4, dtype=torch.long), mask, torch.zeros(2, 3), torch.zeros(2),
        old_logprobs=torch.zeros(2, 3) if old else None,
    )  # fmt: skip


def _reason(overrides: list[str], rows: RLBatch, **tf_attrs: object) -> str | None:
    """The decision for ``rows`` under the config and the transformer config PolicyTrainer
    builds from it (``tf_attrs``: set on that afterwards)."""
    from titan_core.accelerator.cpu import CpuAccelerator
    from titan_core.models.gpt import build_transformer_config

    cfg = load_config(GRPOConfig, None, overrides)
    tf = build_transformer_config(cfg.pretrain_view(1), CpuAccelerator())
    for key, value in tf_attrs.items():
        setattr(tf, key, value)
    return old_logprobs_forward_reason(cfg, tf, rows)


MOE = ["model.num_moe_experts=4", "model.moe_router_topk=2"]


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ([], None),
        (["algo.use_tis=true"], None),
        (["algo.use_icepop=true"], None),
        (["algo.use_kl_loss=true", "algo.kl_loss_coef=0.1", "algo.entropy_coef=0.01"], None),
        ([*MOE, "algo.routing_replay=true"], None),
        (["algo.recompute_old_logprobs=true"], "algo.recompute_old_logprobs"),
        (["train.ppo_steps=2"], "train.ppo_steps=2"),
        (["algo.use_kl_in_reward=true", "algo.kl_in_reward_coef=0.1"], "use_kl_in_reward"),
        (["algo.use_rs=true"], "algo.use_rs"),
        (["model.hidden_dropout=0.1"], "dropout 0.1"),
        (["model.attention_dropout=0.1"], "dropout 0.1"),
        ([*MOE, "model.moe_router_load_balancing_type=sinkhorn"], "sinkhorn"),
    ],
)
def test_the_update_forward_is_the_old_policy_only_where_nothing_needs_it_earlier(
    overrides, reason
):
    got = _reason(overrides, _rows())
    assert got is None if reason is None else reason in got


def test_moe_input_jitter_keeps_the_separate_forward() -> None:
    got = _reason(MOE, _rows(), moe_input_jitter_eps=0.01)
    assert got is not None and "jitter" in got


def test_old_logprobs_the_batch_brings_are_used_as_they_are() -> None:
    """slime / miles compute them once for several optimizer steps: no forward either way."""
    assert _reason([], _rows(old=True)) == "the batch brings its own old logprobs"
