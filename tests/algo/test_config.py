"""AlgoConfig: defaults, and impossible values rejected with the key named."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, Field

from titan_core.config import ConfigError, load_config
from titan_rl.algo import AlgoConfig


class _Root(BaseModel):
    algo: AlgoConfig = Field(default_factory=AlgoConfig)


def test_defaults():
    cfg = load_config(_Root).algo
    assert cfg.advantage_estimator == "grpo" and cfg.loss_agg_mode == "token_mean"
    assert cfg.clip_high == 0.2 and cfg.eps_clip_c is None and cfg.kl_loss_type == "low_var_kl"


def test_overrides():
    cfg = load_config(
        _Root,
        None,
        ["algo.advantage_estimator=gspo", "algo.eps_clip_high=0.28", "algo.use_tis=true"],
    ).algo
    assert cfg.advantage_estimator == "gspo" and cfg.clip_high == 0.28 and cfg.use_tis


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algo.eps_clip_c=0.5", "algo.eps_clip_c"),
        ("algo.eps_clip=0", "algo.eps_clip"),
        ("algo.eps_clip=1.5", "algo.eps_clip"),
        ("algo.eps_clip_high=-0.1", "algo.eps_clip_high"),
        ("algo.gamma=1.5", "algo.gamma"),
        ("algo.tis_clip=0", "algo.tis_clip"),
        ("algo.kl_loss_coef=-1", "algo.kl_loss_coef"),
        ("algo.advantage_estimator=ppo", "algo.advantage_estimator"),
        ("algo.loss_agg_mode=sum", "algo.loss_agg_mode"),
        ("algo.kl_loss_type=k4", "algo.kl_loss_type"),
        ("algo.eps=0.2", "algo.eps"),
        ("algo.kl_loss_coef=0.1", "algo.use_kl_loss"),
        ("algo.kl_in_reward_coef=0.1", "algo.use_kl_in_reward"),
    ],
)
def test_bad_values_name_the_key(override: str, key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(_Root, None, [override])
