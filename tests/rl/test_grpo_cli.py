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


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_missing_dataset_exits_2_before_any_pretraining(tmp_path):
    """A broken dataset is a user error (exit 2, one line), found before the base policy
    would be pretrained (policy.load holds no checkpoint here)."""
    path = tmp_path / "d.jsonl"
    proc = _grpo(
        "--config", str(REPO / "examples/math.yaml"), "data.type=jsonl", f"data.path={path}",
        f"policy.load={tmp_path / 'base' / 'checkpoints'}", f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == f"error: data.path {path} is not a file; check the path\n"
    assert "pretraining" not in proc.stdout and not (tmp_path / "base").exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"prompt": "1+1=", "label": "2"}\n{broken\n', "data.path {path}:2: not valid JSON"),
        ('{"q": "1+1=", "a": "2"}\n', "no row has both 'prompt' and 'label'"),
    ],
    ids=["bad-json", "no-usable-row"],
)
def test_unusable_dataset_exits_2(tmp_path, capsys, content, needle):
    from titan_rl.grpo import main

    path = tmp_path / "d.jsonl"
    path.write_text(content)
    code = main([
        "--config", str(REPO / "examples/math.yaml"), "data.type=jsonl", f"data.path={path}",
        f"policy.load={tmp_path / 'base' / 'checkpoints'}", f"run.dir={tmp_path / 'run'}",
    ])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and needle.format(path=path) in err
    assert not (tmp_path / "base").exists()


def test_eval_path_rows_are_checked_and_counted(tmp_path, capsys):
    from titan_rl.grpo import Loop

    train = _jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "x"}])
    held_out = _jsonl(
        tmp_path / "e.jsonl",
        [{"prompt": "2+2=", "label": "4"}, {"label": "5"}, {"prompt": "3+3="}, {"a": 1}],
    )
    overrides = ["data.type=jsonl", f"data.path={train}", f"run.dir={tmp_path / 'run'}"]
    cfg = load_config(GRPOConfig, REPO / "examples/math.yaml", overrides)
    loop = Loop(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_path": str(held_out)})})
    )
    assert [p.text for p in loop.eval_prompts] == ["2+2="]
    assert loop.data_stats == {"data/skipped_rows": 1, "data/eval_skipped_rows": 3}
    out = capsys.readouterr().out
    assert f"skipped 1 rows of data.path {train}" in out
    assert f"skipped 3 rows of data.eval_path {held_out}" in out
    bad = _jsonl(tmp_path / "bad.jsonl", [{"q": "x"}])
    cfg = load_config(
        GRPOConfig, REPO / "examples/math.yaml", [*overrides, f"data.eval_path={bad}"]
    )
    with pytest.raises(DatasetError, match="data.eval_path"):
        Loop(cfg)


def test_async_and_colocated_exit_2_naming_both_keys(capsys):
    from titan_rl.grpo import main

    args = ["rollout.async=true", "engines.colocate=true", "--dry-run"]
    assert main(["--config", str(REPO / "examples/math.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "rollout.async" in err and "engines.colocate" in err


def test_defaults_that_follow_the_mode():
    """async: TIS on (off-policy correction) unless set; colocated: the sync resumes the KV
    cache after loading the weights."""
    from titan_rl.grpo import resolve_config

    def resolved(*overrides: str) -> GRPOConfig:
        return resolve_config(load_config(GRPOConfig, REPO / "examples/math.yaml", list(overrides)))

    assert resolved().algo.use_tis is False and resolved().sync.resume_kv_cache is False
    assert resolved("rollout.async=true").algo.use_tis is True
    assert resolved("rollout.async=true", "algo.use_tis=false").algo.use_tis is False
    assert resolved("algo.use_tis=true").algo.use_tis is True
    cfg = resolved("engines.colocate=true")
    assert cfg.sync.resume_kv_cache is True and resolve_config(cfg) == cfg
    assert (
        resolved("engines.colocate=true", "sync.resume_kv_cache=false").sync.resume_kv_cache
        is False
    )
    with pytest.raises(ConfigError, match="engines.colocate=true"):
        resolved("sync.resume_kv_cache=true")
