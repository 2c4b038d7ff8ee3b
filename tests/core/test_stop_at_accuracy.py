"""train.stop_at_eval_accuracy: pretraining stops (and saves) at the first evaluation that
reaches the target, says so, and a rerun neither retrains nor drifts; train_iters is the cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.core.pretrain_runner import REPO, TINY, run_pretrain
from titan_core.checkpoint import latest_iteration
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.pretrain import main
from titan_core.training.metrics import read_metrics

#: on top of TINY: 1-digit addition, one problem per row, on a smaller GPT; held-out
#: accuracy passes 0.5 within ~100 steps
TINY_SFT = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.ffn_hidden_size=256",
    "model.seq_length=8",
    "model.max_position_embeddings=16",
    "train.micro_batch_size=32",
    "train.global_batch_size=32",
    "train.lr=3e-3",
    "train.min_lr=3e-3",
    "train.lr_decay_style=constant",
    "train.lr_warmup_iters=5",
    "train.weight_decay=0",
    "train.eval_interval=5",
    "train.eval_iters=2",
    "train.log_interval=1000",
    "data.type=arithmetic_sft",
    "data.num_digits=1",
    "data.num_samples=5000",
    "checkpoint.save_interval=0",
]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["train.stop_at_eval_accuracy=0.5"], "set train.eval_interval"),
        (["train.eval_interval=5", "train.stop_at_eval_accuracy=0"], "stop_at_eval_accuracy"),
        (["train.eval_interval=5", "train.stop_at_eval_accuracy=1.5"], "stop_at_eval_accuracy"),
    ],
)
def test_bad_target_names_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(PretrainConfig, None, overrides)


def test_bad_target_is_exit_2_before_training(capsys):
    assert main(["train.stop_at_eval_accuracy=0.5"]) == 2
    assert "train.stop_at_eval_accuracy needs evaluations" in capsys.readouterr().err


def test_demo_base_stops_inside_the_band_rl_needs():
    """The main job's base stops once it answers 20% of held-out problems (RL needs a signal)
    and well below 50% (RL needs room), checking often enough to catch the jump."""
    cfg = load_config(PretrainConfig, REPO / "examples/pretrain_math_base.yaml")
    t = cfg.train
    assert t.stop_at_eval_accuracy is not None and 0.2 <= t.stop_at_eval_accuracy < 0.5
    assert t.eval_interval is not None and t.eval_interval <= 25
    assert t.train_iters >= 2000  # the cap, several times the typical stopping step


def _evals(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "eval/accuracy" in r]


@pytest.mark.slow
def test_trains_until_the_first_eval_meeting_the_target_then_stays(tmp_path):
    run = tmp_path / "run"
    base = [*TINY_SFT, f"run.dir={run}"]

    # an unreachable target: the run goes to train_iters (the cap) and says it fell short
    proc = run_pretrain(TINY, [*base, "train.train_iters=10", "train.stop_at_eval_accuracy=1.0"])
    assert _evals(run)[-1]["step"] == 10 and _evals(run)[-1]["eval/accuracy"] < 1.0
    assert "reached train.train_iters=10" in proc.stdout
    assert "below train.stop_at_eval_accuracy=1.0" in proc.stdout
    assert latest_iteration(run / "checkpoints") == 10

    # a reachable one: resumes from that checkpoint and stops at the first eval reaching it
    target, cap = 0.5, 400
    args = [*base, f"train.train_iters={cap}", f"train.stop_at_eval_accuracy={target}"]
    proc = run_pretrain(TINY, args, timeout=600)
    assert f"resumed from {run / 'checkpoints'} at step 10" in proc.stdout
    evals = _evals(run)
    stop = evals[-1]["step"]
    assert [e["step"] for e in evals] == list(range(5, stop + 1, 5))
    assert evals[-1]["eval/accuracy"] >= target
    assert all(e["eval/accuracy"] < target for e in evals[:-1])
    assert stop < cap and read_metrics(run / "metrics.jsonl")[-1]["step"] == stop
    assert f"stopped at step {stop} (cap {cap})" in proc.stdout
    assert latest_iteration(run / "checkpoints") == stop

    # the same command again: the saved model already meets the target, nothing changes
    proc = run_pretrain(TINY, args, timeout=600)
    assert "nothing to do" in proc.stdout
    assert latest_iteration(run / "checkpoints") == stop
    assert read_metrics(run / "metrics.jsonl")[-1]["step"] == stop
