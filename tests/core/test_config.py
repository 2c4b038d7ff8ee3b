"""Config errors: unknown keys, wrong types and impossible layouts name the key; exit code 2."""

from __future__ import annotations

import pytest

from tests.core.pretrain_runner import TINY, run_pretrain
from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import PretrainConfig, check_layout


def test_defaults_are_valid():
    cfg = load_config(PretrainConfig)
    assert check_layout(cfg, 1) == 1


def test_override_types_are_parsed():
    cfg = load_config(
        PretrainConfig, TINY, ["train.lr=1e-2", "train.bf16=true", "model.num_layers=8"]
    )
    assert cfg.train.lr == 1e-2 and cfg.train.bf16 is True and cfg.model.num_layers == 8


@pytest.mark.parametrize(
    "override, needle",
    [
        (["model.hiden_size=64"], "model.hiden_size: unknown key"),
        (["trian.lr=1"], "trian: unknown key"),
        (["train.lr=fast"], "train.lr: Input should be a valid number"),
        (["model.num_layers=-2"], "model.num_layers"),
        (["model.num_layers=5", "parallel.pipeline_model_parallel_size=2"], "model.num_layers (5)"),
        (["model.num_attention_heads=3"], "model.hidden_size (128) must be divisible"),
        (["parallel.expert_model_parallel_size=2"], "model.num_moe_experts"),
        (["train.bf16=true", "train.fp16=true"], "exclusive"),
        (["train.lr_warmup_iters=500"], "train.lr_warmup_iters"),
        (["lr=3"], "lr: unknown key"),
        (["train.lr"], "not of the form key.sub=value"),
    ],
)
def test_bad_config_names_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, TINY, override)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "world, override, needle",
    [
        (3, ["parallel.tensor_model_parallel_size=2"], "world size 3 is not divisible"),
        (2, ["train.global_batch_size=16", "train.micro_batch_size=16"], "train.global_batch_size"),
        (
            2,
            ["parallel.pipeline_model_parallel_size=2", "parallel.virtual_pipeline_model_parallel_size=2",
             "train.micro_batch_size=8", "train.global_batch_size=24"],
            "multiple of parallel.pipeline_model_parallel_size",
        ),
    ],
)  # fmt: skip
def test_bad_layout_for_world_size(world, override, needle):
    cfg = load_config(PretrainConfig, TINY, override)
    with pytest.raises(ConfigError) as e:
        check_layout(cfg, world)
    assert needle in str(e.value)


def test_cli_exits_2_with_the_message(tmp_path):
    proc = run_pretrain(TINY, ["model.hiden_size=64", f"run.dir={tmp_path}"], check=False)
    assert proc.returncode == 2
    assert "model.hiden_size: unknown key" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_cli_bad_layout_fails_before_process_groups(tmp_path):
    proc = run_pretrain(
        TINY, ["parallel.tensor_model_parallel_size=2", f"run.dir={tmp_path}"], check=False
    )
    assert proc.returncode == 2
    assert "world size 1 is not divisible" in proc.stderr


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "nope.yaml")
