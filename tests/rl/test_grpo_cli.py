"""GRPO as a user starts it: --dry-run on every example, config errors, dataset rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig, RLDataConfig
from titan_rl.data import DatasetError, PromptSampler, load_file_prompts, load_prompts

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("math*.yaml"))


def _grpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "titan_rl.grpo", *args], capture_output=True, text=True, cwd=REPO
    )


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_dry_run_every_example(example):
    proc = _grpo("--config", str(example), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "trainer:" in proc.stdout and "engines:" in proc.stdout


def test_unknown_key_exits_2():
    proc = _grpo("--config", str(REPO / "examples/math.yaml"), "rollout.n_sample=4", "--dry-run")
    assert proc.returncode == 2
    assert "rollout.n_sample: unknown key" in proc.stderr


@pytest.mark.parametrize(
    "override, needle",
    [
        (
            ["rollout.n_samples_per_prompt=1", "train.micro_batch_size=32"],
            "n_samples_per_prompt >= 2",
        ),
        (["train.micro_batch_size=7"], "divisible by train.micro_batch_size"),
        (["data.type=jsonl"], "data.path is required"),
        (["sync.transport=carrier_pigeon"], "sync.transport"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.").replace("(", r"\(")):
        load_config(GRPOConfig, REPO / "examples/math.yaml", override)


def test_dataset_rows_missing_keys_are_skipped_and_counted(tmp_path):
    rows = [
        {"prompt": "1+1=", "label": "2"},
        {"question": "no prompt key", "label": "3"},
        {"prompt": "2+2="},
        {"prompt": "3+3=", "label": 6, "source": "x"},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = RLDataConfig(type="jsonl", path=str(path))
    ps = load_file_prompts(str(path), cfg)
    assert [p.text for p in ps.prompts] == ["1+1=", "3+3="]
    assert ps.prompts[1].label == "6" and ps.prompts[1].metadata == {"source": "x"}
    assert ps.skipped == 2


def test_dataset_without_any_usable_row(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "x", "a": "y"}))
    with pytest.raises(DatasetError, match="data.prompt_key"):
        load_file_prompts(str(path), RLDataConfig(type="jsonl", path=str(path)))


def test_parquet_dataset(tmp_path):
    import polars as pl

    path = tmp_path / "d.parquet"
    pl.DataFrame({"problem": ["1+2=", "5+5="], "answer": ["3", None]}).write_parquet(path)
    cfg = RLDataConfig(type="parquet", path=str(path), prompt_key="problem", label_key="answer")
    ps = load_file_prompts(str(path), cfg)
    assert [p.label for p in ps.prompts] == ["3"] and ps.skipped == 1


def test_arithmetic_train_and_eval_are_disjoint_and_resume_exactly():
    cfg = RLDataConfig()
    train = load_prompts(cfg, seed=3, split="train", num=2000).prompts
    held_out = load_prompts(cfg, seed=3, split="eval").prompts
    assert len(held_out) == 500
    assert {p.text for p in held_out}.isdisjoint({p.text for p in train})
    a = PromptSampler(train, seed=1)
    a.take(1500)
    state = a.state()
    nxt = a.take(900)  # crosses an epoch boundary
    b = PromptSampler(train, seed=1)
    b.restore(state)
    assert b.take(900) == nxt
