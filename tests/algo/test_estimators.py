"""One table of advantage estimators (titan_rl.algo.estimators) that the config's choices,
the one-sample-per-prompt check and the preflight's warnings read, and that matches what
compute_advantages does: a group-baseline estimator with one sample per prompt never lets the
reward reach an advantage, so the config refuses it (reinforce_plus_plus_baseline passed
the check and trained on all-zero advantages)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import torch

from titan_core.config import ConfigError, load_config
from titan_rl.algo import AlgoConfig, compute_advantages
from titan_rl.algo.estimators import ESTIMATORS, GROUP_ESTIMATORS
from titan_rl.config import GRPOConfig
from titan_rl.preflight import learning_warnings

MATH = Path(__file__).resolve().parents[2] / "examples" / "math.yaml"


def test_the_config_offers_exactly_the_tables_estimators():
    field = AlgoConfig.model_fields["advantage_estimator"]
    assert typing.get_args(field.annotation) == tuple(ESTIMATORS)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_the_table_says_what_compute_advantages_does(name):
    """Group of one, no KL: a group baseline equals the reward, so no advantage carries it."""
    torch.manual_seed(0)
    cfg = AlgoConfig(advantage_estimator=name)
    mask = torch.ones(6, 3)
    rewards = torch.rand(6)
    try:
        adv = compute_advantages(rewards, 1, mask, cfg)
        reward_reaches = bool(adv.abs().max() > 0)
    except ValueError:  # rloo refuses a group of one
        reward_reaches = False
    assert reward_reaches is not ESTIMATORS[name].group_baseline
    # groups of two: every estimator learns from the rewards
    assert compute_advantages(rewards, 2, mask, cfg).abs().max() > 0


@pytest.mark.parametrize("kl", [[], ["algo.use_kl_in_reward=true", "algo.kl_in_reward_coef=0.1"]])
@pytest.mark.parametrize("name", GROUP_ESTIMATORS)
def test_one_sample_per_prompt_is_refused_for_every_group_estimator(name, kl):
    one = ["rollout.n_samples_per_prompt=1", "train.micro_batch_size=32"]
    with pytest.raises(ConfigError) as e:
        load_config(GRPOConfig, MATH, [f"algo.advantage_estimator={name}", *one, *kl])
    msg = str(e.value)
    assert f"algo.advantage_estimator={name}" in msg
    assert "rollout.n_samples_per_prompt=1" in msg and "n_samples_per_prompt >= 2" in msg


def test_a_batch_baseline_takes_one_sample_per_prompt():
    assert "reinforce_plus_plus" not in GROUP_ESTIMATORS
    one = ["rollout.n_samples_per_prompt=1", "train.micro_batch_size=32"]
    cfg = load_config(GRPOConfig, MATH, ["algo.advantage_estimator=reinforce_plus_plus", *one])
    assert cfg.rollout.n_samples_per_prompt == 1


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_greedy_sampling_is_warned_for_the_tables_group_estimators(name):
    cfg = load_config(GRPOConfig, MATH, [f"algo.advantage_estimator={name}"])
    cfg.rollout.temperature = 0.0
    warned = any("rollout.temperature=0" in line for line in learning_warnings(cfg))
    assert warned is ESTIMATORS[name].group_baseline


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_from_group_rewards_is_what_compute_advantages_does(name):
    """Another group's rewards and response lengths leave a group's advantages alone, the
    same on each of its tokens, exactly for the table's ``from_group_rewards`` estimators
    (the others whiten over the batch's tokens)."""
    cfg = AlgoConfig(advantage_estimator=name)
    rewards = torch.tensor([1.0, 0.0, 0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]]).float()
    other_rewards = torch.tensor([1.0, 0.0, 3.0, -1.0])
    other_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).float()
    first = compute_advantages(rewards, 2, mask, cfg)[:2]
    again = compute_advantages(other_rewards, 2, other_mask, cfg)[:2]
    per_token = [set(row[m.bool()].tolist()) for row, m in zip(first, mask[:2], strict=True)]
    local = torch.equal(first, again) and all(len(v) == 1 for v in per_token)
    assert local is ESTIMATORS[name].from_group_rewards


def test_gspo_alone_takes_a_sequence_ratio_in_the_loss():
    """``sequence_ratio``: the loss of a sequence-ratio estimator differs from grpo's on the
    same advantages, and no other estimator's does."""
    from titan_rl.algo import policy_loss

    g = torch.Generator().manual_seed(0)
    logprobs = torch.rand(4, 5, generator=g).log()
    old = logprobs + 0.1 * torch.randn(4, 5, generator=g)
    adv, mask = torch.randn(4, 5, generator=g), torch.ones(4, 5)
    grpo, _ = policy_loss(logprobs, old, adv, mask, AlgoConfig())
    for name, est in ESTIMATORS.items():
        loss, _ = policy_loss(logprobs, old, adv, mask, AlgoConfig(advantage_estimator=name))
        assert (not torch.equal(loss, grpo)) is est.sequence_ratio, name


def test_the_adapters_train_the_estimators_computed_from_group_rewards():
    """slime's / miles' --advantage-estimator choices the Titan backend accepts are Titan's
    ``from_group_rewards`` estimators (their rollout side normalises the rewards)."""
    from adapters.common.flag_table import FLAG_TABLE

    entry = FLAG_TABLE["advantage_estimator"]
    slime = ("grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")
    assert [n for n in slime if not entry.refuses(n)] == ["grpo", "gspo"]
    for name, est in ESTIMATORS.items():
        assert entry.refuses(name) is not est.from_group_rewards, name
