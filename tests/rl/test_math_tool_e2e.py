"""examples/math_tool.yaml end to end, shortened: the job pretrains its tool-mixed base
through policy.pretrain_config (a few steps here), then runs GRPO with the calculator hook
and the tool-answer reward; eval accuracy and the multi-turn tool metrics are recorded."""

from __future__ import annotations

from pathlib import Path

import pytest

from titan_core.config import load_config
from titan_core.config.pretrain import PretrainConfig
from titan_core.training.metrics import read_metrics
from titan_rl.config import GRPOConfig
from titan_rl.grpo import resolve_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "examples/math_tool.yaml"


def test_the_example_and_its_base_recipe_agree() -> None:
    job = resolve_config(load_config(GRPOConfig, CONFIG))
    assert job.rollout.generate_fn == "titan_rl.rollout.calculator:generate"
    assert job.reward.custom_path == "titan_rl.rewards.tool_answer:score"
    base = load_config(PretrainConfig, REPO / str(job.policy.pretrain_config))
    assert base.data.type == "arithmetic_sft" and 0 < base.data.tool_fraction < 0.5
    assert Path(job.policy.load).parent == Path(base.run.dir)
    for key in ("num_layers", "hidden_size", "seq_length", "max_position_embeddings"):
        assert getattr(job.model, key) == getattr(base.model, key), key


@pytest.mark.slow
def test_math_tool_example_records_tool_use_and_eval_accuracy(math_tool_run) -> None:
    # the job (tests/rl/conftest.py): a 120-step base pretrained through
    # policy.pretrain_config, then 3 GRPO steps
    proc, run_dir = math_tool_run.proc, math_tool_run.run_dir
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert (math_tool_run.base / "checkpoints").is_dir()
    records = read_metrics(run_dir / "metrics.jsonl")
    evals = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 3]
    assert all(0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    steps = [r for r in records if "rollout/tool_use_rate" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert 1.0 <= r["rollout/turns_mean"] <= 3.0
        assert 0.0 <= r["rollout/tool_error_rate"] <= 1.0
        assert r["rollout/tool_calls_mean"] >= r["rollout/tool_use_rate"]
    # a base trained on half tool transcripts calls the calculator when sampled
    assert max(r["rollout/tool_use_rate"] for r in steps) > 0.05
    assert (run_dir / "reward.png").exists()
