"""The RL job's base policy: pretrained (or trained on) with titan_core.pretrain when needed.

A base that answers almost nothing gives GRPO no reward signal, so the job checks the base's
held-out accuracy (the last ``eval/accuracy`` its pretraining wrote) against the pretraining
config's ``train.stop_at_eval_accuracy``, and trains it on from its checkpoint when below.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from titan_core.checkpoint import latest_iteration
from titan_core.child_process import run_child, stopped_by
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.signals import Stopped, signal_name
from titan_core.training.metrics import read_metrics
from titan_rl.config import PolicyConfig


def base_accuracy(run_dir: Path, iteration: int) -> float | None:
    """The last held-out accuracy a pretraining run in ``run_dir`` logged up to ``iteration``
    (its checkpoint), or None when it logged none."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    evals = [
        r["eval/accuracy"]
        for r in read_metrics(path)
        if r.get("eval/accuracy") is not None and r.get("step", 0) <= iteration
    ]
    return evals[-1] if evals else None


#: in the base's run dir while its pretraining has not finished (a job stopped or killed
#: meanwhile leaves it, and the next one trains the base on from its checkpoint)
UNFINISHED = ".pretraining_unfinished"


def _pretrain(pol: PolicyConfig, run_dir: Path) -> None:
    """titan_core.pretrain as a child that stops with this job (titan_core.child_process)."""
    cmd = [
        sys.executable, "-m", "titan_core.pretrain", "--config", str(pol.pretrain_config),
        *pol.pretrain_overrides, f"run.dir={run_dir}",
    ]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / UNFINISHED).touch()
    code = run_child(cmd)
    signum = stopped_by(code)
    if signum is not None:
        raise Stopped(
            signum,
            f"stopped by {signal_name(signum)} while pretraining the base policy in {run_dir}; "
            "rerun the same command to train it on from its last checkpoint",
        )
    if code != 0:
        raise subprocess.CalledProcessError(code, cmd)
    (run_dir / UNFINISHED).unlink(missing_ok=True)


def base_training(pol: PolicyConfig) -> str | None:
    """What :func:`ensure_base_policy` would train the base for, as the line it says (None:
    the base is there and good enough, nothing to train). Raises ConfigError where
    ``policy.load`` cannot be used: no checkpoint and none to pretrain, or not where
    ``policy.pretrain_config`` trains it."""
    training = _training(pol)
    return None if training is None else training[0]


def _training(pol: PolicyConfig) -> tuple[str, float | None] | None:
    """:func:`base_training`'s line, with the recipe's ``train.stop_at_eval_accuracy``."""
    if pol.format != "titan":
        return None
    have = latest_iteration(pol.load)
    if not pol.pretrain_config:
        if have is None:
            raise ConfigError(
                f"policy.load {pol.load} holds no Titan checkpoint and policy.pretrain_config "
                "is not set; pretrain one first (python -m titan_core.pretrain) or set it"
            )
        return None
    load = Path(pol.load)
    if load.name != "checkpoints":
        raise ConfigError("policy.load must end in /checkpoints when policy.pretrain_config is set")
    recipe = load_config(PretrainConfig, pol.pretrain_config, pol.pretrain_overrides)
    target = recipe.train.stop_at_eval_accuracy
    if have is None and Path(recipe.run.dir).resolve() != load.parent.resolve():
        # a mistyped policy.load would otherwise start minutes of pretraining in its place
        raise ConfigError(
            f"policy.load {load} holds no Titan checkpoint, and it is not where "
            f"policy.pretrain_config ({pol.pretrain_config}) trains its base (run.dir "
            f"{recipe.run.dir}). If policy.load is mistyped, correct it; to pretrain a new "
            f"base there, add run.dir={load.parent} to policy.pretrain_overrides"
        )
    if have is None:
        return (
            f"no base checkpoint at {load}: pretraining it first with titan_core.pretrain "
            f"({pol.pretrain_config}), on the same training base"
        ), target
    if (load.parent / UNFINISHED).exists():
        return (
            f"the base's pretraining at {load} stopped at step {have} before it finished: "
            "training it on"
        ), target
    acc = base_accuracy(load.parent, have)
    if target is None or acc is None or acc >= target:
        return None
    return (
        f"the base at {load} answers {acc:.1%} of held-out problems, below "
        f"train.stop_at_eval_accuracy={target} of {pol.pretrain_config}: training it on"
    ), target


def ensure_base_policy(pol: PolicyConfig) -> None:
    """Pretrain the Titan base at ``pol.load`` if missing; train it on if its accuracy is
    below ``train.stop_at_eval_accuracy`` of ``pol.pretrain_config``. Says what it does."""
    training = _training(pol)
    if training is None:
        return
    why, target = training
    print(why, flush=True)
    load = Path(pol.load)
    _pretrain(pol, load.parent)
    it = latest_iteration(load)
    acc = base_accuracy(load.parent, it) if it is not None else None
    if acc is None:
        return
    print(f"base policy: {acc:.1%} held-out accuracy after {it} pretraining steps", flush=True)
    if target is not None and acc < target:
        print(
            f"warning: the base is below train.stop_at_eval_accuracy={target}, and RL learns "
            "little from a base that is rarely right; raise train.train_iters (e.g. "
            "policy.pretrain_overrides=[train.train_iters=6000]) and run again to train it on",
            flush=True,
        )
