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
        ("algo.tis_level=seq", "algo.tis_level"),
        ("algo.rs_level=geo", "algo.rs_level"),
        ("algo.rs_upper_bound=0", "algo.rs_upper_bound"),
        ("algo.icepop_alpha=-1", "algo.icepop_alpha"),
    ],
)
def test_bad_values_name_the_key(override: str, key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(_Root, None, [override])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["algo.tis_clip_low=3", "algo.tis_clip=2"], "algo.tis_clip_low"),
        (["algo.rs_lower_bound=0.9", "algo.rs_upper_bound=0.8"], "algo.rs_lower_bound"),
        (["algo.rs_upper_bound=0.5"], "algo.rs_lower_bound"),  # unset: 1 / 0.5 = 2 > 0.5
        (["algo.icepop_alpha=2", "algo.icepop_beta=1.5"], "algo.icepop_alpha"),
        (["algo.use_icepop=true", "algo.use_tis=true"], "algo.use_tis=false"),
    ],
)
def test_correction_bounds_out_of_order_name_the_key(overrides: list[str], key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(_Root, None, overrides)


def test_correction_defaults_are_upstreams():
    cfg = load_config(_Root, None, ["algo.use_rs=true", "algo.use_icepop=true"]).algo
    # slime / miles: --tis-clip 2, --tis-clip-low 0; mis.yaml rs bounds fall back to [0.5, 2]
    assert (cfg.tis_clip, cfg.tis_clip_low, cfg.tis_level) == (2.0, 0.0, "token")
    assert cfg.rs_bounds == (0.5, 2.0) and cfg.rs_level == "token"
    assert (cfg.icepop_alpha, cfg.icepop_beta) == (0.5, 5.0)
    assert load_config(_Root, None, ["algo.rs_upper_bound=4"]).algo.rs_bounds == (0.25, 4.0)
    # equal bounds are allowed (keep only ratios exactly there)
    assert load_config(_Root, None, ["algo.tis_clip_low=2"]).algo.tis_clip_low == 2.0
