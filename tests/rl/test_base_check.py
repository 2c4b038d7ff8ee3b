"""The RL job's base: pretrained when missing, trained on when its held-out accuracy is below
the pretraining config's train.stop_at_eval_accuracy, left alone otherwise; it says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import titan_rl.base_policy as base_policy
from titan_core.config import ConfigError
from titan_rl.config import PolicyConfig

#: a pretraining recipe that stops at 20% held-out accuracy
RECIPE = "train:\n  eval_interval: 25\n  stop_at_eval_accuracy: 0.2\n"


def _fake_run(run_dir: Path, evals: list[tuple[int, float]]) -> None:
    """A pretraining run's traces: metrics.jsonl with these evals, a checkpoint at the last
    (its iteration in ``checkpoints/latest``, read by the patched ``latest_iteration``)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "a") as f:
        for step, acc in evals:
            f.write(json.dumps({"step": step, "loss": 1.0, "eval/accuracy": acc}) + "\n")
    (run_dir / "checkpoints").mkdir(exist_ok=True)
    (run_dir / "checkpoints/latest").write_text(str(evals[-1][0]))


def _latest(root: str | Path) -> int | None:
    tracker = Path(root) / "latest"
    return int(tracker.read_text()) if tracker.is_file() else None


@pytest.fixture(autouse=True)
def pretrain_calls(monkeypatch):
    """Replace the pretraining subprocess: each call appends the next fake run's evals."""
    calls: list[Path] = []
    plans: list[list[tuple[int, float]]] = []
    monkeypatch.setattr(base_policy, "latest_iteration", _latest)

    def fake(pol: PolicyConfig, run_dir: Path) -> None:
        calls.append(run_dir)
        _fake_run(run_dir, plans.pop(0))

    monkeypatch.setattr(base_policy, "_pretrain", fake)
    return calls, plans


def _policy(run_dir: Path, **kw) -> PolicyConfig:
    recipe = run_dir.parent / "recipe.yaml"
    recipe.write_text(RECIPE)
    kw["pretrain_overrides"] = [*kw.get("pretrain_overrides", []), f"run.dir={run_dir}"]
    return PolicyConfig(load=str(run_dir / "checkpoints"), pretrain_config=str(recipe), **kw)


def test_missing_base_is_pretrained_and_its_accuracy_reported(tmp_path, pretrain_calls, capsys):
    calls, plans = pretrain_calls
    plans.append([(25, 0.01), (50, 0.27)])
    base_policy.ensure_base_policy(_policy(tmp_path / "base"))
    out = capsys.readouterr().out
    assert calls == [tmp_path / "base"]
    assert "no base checkpoint" in out
    assert "base policy: 27.0% held-out accuracy after 50 pretraining steps" in out
    assert "warning" not in out


def test_base_meeting_the_target_is_left_alone(tmp_path, pretrain_calls, capsys):
    calls, _ = pretrain_calls
    _fake_run(tmp_path / "base", [(25, 0.05), (50, 0.2)])
    base_policy.ensure_base_policy(_policy(tmp_path / "base"))
    assert calls == [] and capsys.readouterr().out == ""


def test_weak_base_is_trained_on_saying_so(tmp_path, pretrain_calls, capsys):
    calls, plans = pretrain_calls
    _fake_run(tmp_path / "base", [(1000, 0.03), (1100, 0.031)])
    plans.append([(1125, 0.12), (1150, 0.34)])
    base_policy.ensure_base_policy(_policy(tmp_path / "base"))
    out = capsys.readouterr().out
    assert calls == [tmp_path / "base"]
    assert "answers 3.1% of held-out problems, below train.stop_at_eval_accuracy=0.2" in out
    assert "training it on" in out
    assert "base policy: 34.0% held-out accuracy after 1150 pretraining steps" in out


def test_base_still_weak_at_the_cap_is_a_warning(tmp_path, pretrain_calls, capsys):
    _, plans = pretrain_calls
    plans.append([(3000, 0.04)])
    base_policy.ensure_base_policy(_policy(tmp_path / "base"))
    out = capsys.readouterr().out
    assert "base policy: 4.0% held-out accuracy after 3000 pretraining steps" in out
    assert "warning: the base is below train.stop_at_eval_accuracy=0.2" in out
    assert "train.train_iters" in out


def test_overrides_set_the_target(tmp_path, pretrain_calls, capsys):
    calls, plans = pretrain_calls
    _fake_run(tmp_path / "base", [(50, 0.3)])
    plans.append([(75, 0.45)])
    pol = _policy(tmp_path / "base", pretrain_overrides=["train.stop_at_eval_accuracy=0.4"])
    base_policy.ensure_base_policy(pol)
    assert calls == [tmp_path / "base"]
    assert "below train.stop_at_eval_accuracy=0.4" in capsys.readouterr().out


def test_evals_after_the_checkpoint_do_not_count(tmp_path, pretrain_calls):
    """A run killed after its last checkpoint logged evals the checkpoint does not hold."""
    calls, plans = pretrain_calls
    _fake_run(tmp_path / "base", [(50, 0.05)])
    with open(tmp_path / "base/metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 75, "eval/accuracy": 0.3}) + "\n")
    plans.append([(100, 0.25)])
    base_policy.ensure_base_policy(_policy(tmp_path / "base"))
    assert calls == [tmp_path / "base"]


def test_base_without_metrics_or_target_is_taken_as_is(tmp_path, pretrain_calls):
    calls, _ = pretrain_calls
    _fake_run(tmp_path / "a", [(50, 0.01)])
    (tmp_path / "a/metrics.jsonl").unlink()
    base_policy.ensure_base_policy(_policy(tmp_path / "a"))
    _fake_run(tmp_path / "b", [(50, 0.01)])
    no_target = ["train.stop_at_eval_accuracy=null"]
    base_policy.ensure_base_policy(_policy(tmp_path / "b", pretrain_overrides=no_target))
    assert calls == []


def test_missing_base_without_a_recipe_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="policy.pretrain_config is not set"):
        base_policy.ensure_base_policy(PolicyConfig(load=str(tmp_path / "checkpoints")))


def test_a_mistyped_load_is_not_pretrained(tmp_path, pretrain_calls):
    """A missing base is pretrained only where the recipe trains it (its run.dir, or one set
    in policy.pretrain_overrides), never in a mistyped place."""
    calls, _ = pretrain_calls
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(RECIPE)
    typo = PolicyConfig(load=str(tmp_path / "bsae" / "checkpoints"), pretrain_config=str(recipe))
    with pytest.raises(ConfigError, match="policy.pretrain_overrides") as e:
        base_policy.ensure_base_policy(typo)
    assert "bsae" in str(e.value) and "is not where" in str(e.value)
    assert calls == [] and not (tmp_path / "bsae").exists()
