"""GRPO as a user starts it: --dry-run on every example, config errors, dataset rows.

The command line runs in this process (``main(argv)``): what a user sees is its exit code
and its output, which ``capsys`` holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from titan_core.config import ConfigError, load_config
from titan_core.data.tokenizer import ByteTokenizer
from titan_rl.config import GRPOConfig, RLDataConfig
from titan_rl.data import (
    DatasetError,
    PromptSampler,
    load_file_prompts,
    load_prompts,
    load_splits,
    stop_token_ids,
)
from titan_rl.grpo import main

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "examples").glob("math*.yaml"))


@dataclass
class Exit:
    code: int
    out: str
    err: str


@pytest.fixture
def grpo(capsys):
    """``python -m titan_rl.grpo ARGS`` as a call: its exit code, stdout and stderr."""

    def call(*args: str) -> Exit:
        capsys.readouterr()  # what came before is not this command's
        code = main(list(args))
        out, err = capsys.readouterr()
        return Exit(code, out, err)

    return call


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_dry_run_every_example(grpo, example):
    res = grpo("--config", str(example), "--dry-run")
    assert res.code == 0, res.err
    assert "trainer:" in res.out and "engines:" in res.out


def test_unknown_key_exits_2(grpo):
    res = grpo("--config", str(REPO / "examples/math.yaml"), "rollout.n_sample=4", "--dry-run")
    assert res.code == 2
    assert "rollout.n_sample: unknown key" in res.err


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


def test_missing_dataset_exits_2_before_any_pretraining(grpo, tmp_path):
    """A broken dataset is a user error (exit 2, one line), found before the base policy
    would be pretrained (policy.load holds no checkpoint here)."""
    path = tmp_path / "d.jsonl"
    res = grpo(
        "--config", str(REPO / "examples/math.yaml"), "data.type=jsonl", f"data.path={path}",
        f"policy.load={tmp_path / 'base' / 'checkpoints'}", f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert res.code == 2, res.out + res.err
    assert res.err == f"error: data.path {path} is not a file; check the path\n"
    assert "pretraining" not in res.out and not (tmp_path / "base").exists()


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"prompt": "1+1=", "label": "2"}\n{broken\n', "data.path {path}:2: not valid JSON"),
        ('{"q": "1+1=", "a": "2"}\n', "no row has both 'prompt' and 'label'"),
    ],
    ids=["bad-json", "no-usable-row"],
)
def test_unusable_dataset_exits_2(grpo, tmp_path, content, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    res = grpo(
        "--config", str(REPO / "examples/math.yaml"), "data.type=jsonl", f"data.path={path}",
        f"policy.load={tmp_path / 'base' / 'checkpoints'}", f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert res.code == 2 and res.err.startswith("error: ") and needle.format(path=path) in res.err
    assert not (tmp_path / "base").exists()


def test_eval_path_rows_are_checked_and_counted(tmp_path, capsys):
    from titan_rl.rollouts import Rollouts

    train = _jsonl(tmp_path / "t.jsonl", [{"prompt": "1+1=", "label": "2"}, {"prompt": "x"}])
    held_out = _jsonl(
        tmp_path / "e.jsonl",
        [{"prompt": "2+2=", "label": "4"}, {"label": "5"}, {"prompt": "3+3="}, {"a": 1}],
    )
    overrides = ["data.type=jsonl", f"data.path={train}", f"run.dir={tmp_path / 'run'}"]
    cfg = load_config(GRPOConfig, REPO / "examples/math.yaml", overrides)
    rollouts = Rollouts(
        cfg.model_copy(update={"data": cfg.data.model_copy(update={"eval_path": str(held_out)})})
    )
    assert [p.text for p in rollouts.eval_prompts] == ["2+2="]
    assert rollouts.data_stats == {"data/skipped_rows": 1, "data/eval_skipped_rows": 3}
    out = capsys.readouterr().out
    assert f"skipped 1 rows of data.path {train}" in out
    assert f"skipped 3 rows of data.eval_path {held_out}" in out
    bad = _jsonl(tmp_path / "bad.jsonl", [{"q": "x"}])
    cfg = load_config(
        GRPOConfig, REPO / "examples/math.yaml", [*overrides, f"data.eval_path={bad}"]
    )
    with pytest.raises(DatasetError, match="data.eval_path"):
        Rollouts(cfg)


@pytest.mark.parametrize("source", ["data.path", "data.eval_path", "arithmetic"])
def test_both_splits_at_once_are_each_split_alone(tmp_path, source):
    """``load_splits`` (what a run loads: the held-out prompts of data.path taken from its one
    read) gives what ``load_prompts`` gives for each split on its own."""
    rows = [{"prompt": f"{i}+1=", "label": str(i + 1)} for i in range(7)] + [{"prompt": "x"}]
    data = {"type": "jsonl", "path": str(_jsonl(tmp_path / "t.jsonl", rows)), "num_eval": 3}
    if source == "data.eval_path":
        data["eval_path"] = str(_jsonl(tmp_path / "e.jsonl", rows[3:]))
    cfg = RLDataConfig(num_eval=3) if source == "arithmetic" else RLDataConfig(**data)
    assert load_splits(cfg, 5) == (load_prompts(cfg, 5, "train"), load_prompts(cfg, 5, "eval"))


def test_async_and_colocated_exit_2_naming_both_keys(grpo):
    args = ["rollout.async=true", "engines.colocate=true", "--dry-run"]
    res = grpo("--config", str(REPO / "examples/math.yaml"), *args)
    assert res.code == 2
    assert res.err.startswith("error: ") and "rollout.async" in res.err
    assert "engines.colocate" in res.err


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


def _word_tokenizer(path: Path, chars: str) -> Path:
    """A tokenizer.json with one token per character of ``chars`` (ids from 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, "<pad>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.save(str(path))
    return path


def test_stop_tokens_come_from_the_task_and_the_tokenizer(tmp_path):
    """Arithmetic answers end at a newline, in the tokenizer's own id for it; a file
    dataset's responses end at end of text only."""
    from titan_rl.rollouts import Rollouts

    def stop_ids(*overrides: str) -> list[int]:
        args = [f"run.dir={tmp_path / 'run'}", "data.num_eval=4", *overrides]
        return Rollouts(load_config(GRPOConfig, REPO / "examples/math.yaml", args)).stop_ids

    assert stop_ids() == [256, ord("\n")]  # the byte tokenizer: <eod>, "\n"
    chars = "0123456789+= ab\n"
    hf = [
        "data.tokenizer_type=hf",
        f"data.tokenizer_model={_word_tokenizer(tmp_path / 't.json', chars)}",
    ]
    assert stop_ids(*hf) == [0, 2 + chars.index("\n")]
    rows = _jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "label": "2"}])
    assert stop_ids("data.type=jsonl", f"data.path={rows}") == [256]
    assert load_prompts(RLDataConfig(), 1, "eval").stop == ("\n",)
    with pytest.raises(DatasetError, match=r"task X ends each response at '\\r\\n'.*\[13, 10\]"):
        stop_token_ids(ByteTokenizer(), ["\r\n"], "task X")  # two tokens


def test_a_stop_text_of_several_tokens_exits_2(tmp_path, grpo):
    """A tokenizer without a newline token cannot end arithmetic answers: exit 2, naming the
    task, before anything is pretrained."""
    tok = _word_tokenizer(tmp_path / "t.json", "0123456789+=")
    res = grpo(
        "--config", str(REPO / "examples/math.yaml"), "data.tokenizer_type=hf",
        f"data.tokenizer_model={tok}", f"policy.load={tmp_path / 'base' / 'checkpoints'}",
        f"run.dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert res.code == 2, res.out + res.err
    assert res.err.startswith("error: data.type=arithmetic ends each response at '\\n'")
    assert not (tmp_path / "base").exists()
