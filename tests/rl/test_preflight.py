"""Config mistakes are caught before any work (issue 23 item 6): the model section against
the base checkpoint, the engines' top_k rule, several engines without a router, and a warning
for settings that cannot learn. All through ``--dry-run``, which runs the same checks."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from titan_core.config import ConfigError, load_config
from titan_core.config.pretrain import ModelConfig
from titan_rl.config import GRPOConfig
from titan_rl.grpo import main

REPO = Path(__file__).resolve().parents[2]
MATH = str(REPO / "examples" / "math.yaml")


def fake_base(root: Path, model: dict) -> Path:
    """A checkpoint folder that passes the load checks and records ``model`` as its config
    (what titan_core.pretrain writes into common.pt); no tensors."""
    ck = root / "checkpoints"
    it = ck / "iter_0000010"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist"}))
    with (it / ".metadata").open("wb") as f:
        pickle.dump(Metadata(state_dict_metadata={}, storage_data={}), f)
    torch.save({"common": {"config": {"model": model}}}, it / "common.pt")
    (ck / "latest_checkpointed_iteration.txt").write_text("10")
    return ck


def math_model() -> dict:
    cfg = load_config(GRPOConfig, MATH, [])
    return ModelConfig.model_validate(cfg.model.model_dump()).model_dump(mode="json")


def test_model_section_must_match_the_base(tmp_path, capsys):
    ck = fake_base(tmp_path, math_model())
    assert main(["--config", MATH, f"policy.load={ck}", "--dry-run"]) == 0
    code = main(
        ["--config", MATH, f"policy.load={ck}", "model.hidden_size=256", "model.num_layers=2",
         "--dry-run"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2
    assert "model.hidden_size=256 (the checkpoint: 128)" in err
    assert "model.num_layers=2 (the checkpoint: 4)" in err
    assert str(ck) in err


def test_a_damaged_base_is_named_before_anything_starts(tmp_path, capsys):
    ck = fake_base(tmp_path, math_model())
    (ck / "iter_0000010" / "common.pt").write_bytes(b"garbage")
    assert main(["--config", MATH, f"policy.load={ck}", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "policy.load" in err and "common.pt" in err


@pytest.mark.parametrize("top_k", [0, -2])
def test_top_k_follows_the_engines_rule(top_k):
    with pytest.raises(ConfigError, match="rollout.top_k"):
        load_config(GRPOConfig, MATH, [f"rollout.top_k={top_k}"])
    assert load_config(GRPOConfig, MATH, ["rollout.top_k=5"]).rollout.top_k == 5


def test_several_engines_need_the_router(capsys):
    assert main(["--config", MATH, "engines.num_engines=2", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "engines.router=true" in err and "rollout.router" not in err
    assert (
        main(["--config", MATH, "engines.num_engines=2", "engines.router=true", "--dry-run"]) == 0
    )


def test_settings_that_cannot_learn_are_warned(capsys):
    assert main(["--config", MATH, "rollout.temperature=0", "--dry-run"]) == 0
    assert "rollout.temperature=0" in capsys.readouterr().err
    assert main(["--config", MATH, "--dry-run"]) == 0
    assert "warning" not in capsys.readouterr().err
