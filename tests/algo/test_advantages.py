"""Advantage estimators against values worked out by hand."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from titan_rl.algo import AlgoConfig, compute_advantages


def _cfg(**kw) -> AlgoConfig:
    return AlgoConfig(**kw)


def _per_row(adv: torch.Tensor, mask: torch.Tensor, expected_rows: list[float]) -> None:
    """Each row's advantage is its expected value on response tokens and 0 elsewhere."""
    want = torch.tensor(expected_rows)[:, None] * mask
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


MASK4 = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)


def test_grpo_std_normalized():
    # group 0: [1, 0] -> mean 0.5, unbiased std sqrt(0.5) ; group 1: equal rewards -> 0
    rewards = torch.tensor([1.0, 0.0, 2.0, 2.0])
    adv = compute_advantages(rewards, 2, MASK4, _cfg(advantage_estimator="grpo"))
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    _per_row(adv, MASK4, [a, -a, 0.0, 0.0])


def test_grpo_group_of_four():
    # [1, 0, 1, 0]: mean 0.5, unbiased var (4 * 0.25) / 3 = 1/3
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv = compute_advantages(rewards, 4, MASK4, _cfg())
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    _per_row(adv, MASK4, [a, -a, a, -a])
    assert abs(a - 0.866025) < 1e-5


def test_grpo_without_std_and_gspo_equals_grpo():
    rewards = torch.tensor([3.0, 1.0, 0.0, 4.0])
    adv = compute_advantages(rewards, 2, MASK4, _cfg(normalize_advantage_std=False))
    _per_row(adv, MASK4, [1.0, -1.0, -2.0, 2.0])
    for std in (True, False):
        g = compute_advantages(
            rewards, 2, MASK4, _cfg(advantage_estimator="gspo", normalize_advantage_std=std)
        )
        r = compute_advantages(rewards, 2, MASK4, _cfg(normalize_advantage_std=std))
        torch.testing.assert_close(g, r)


def test_dr_grpo_never_divides_by_std():
    rewards = torch.tensor([3.0, 1.0, 0.0, 4.0])
    adv = compute_advantages(rewards, 2, MASK4, _cfg(advantage_estimator="dr_grpo"))
    _per_row(adv, MASK4, [1.0, -1.0, -2.0, 2.0])


def test_rloo_leave_one_out():
    mask = torch.ones(6, 2)
    # group [2, 4, 6]: 2 - mean(4, 6) = -3, 4 - mean(2, 6) = 0, 6 - mean(2, 4) = 3
    # group [1, 0, 0]: 1 - 0 = 1, 0 - mean(1, 0) = -0.5 (twice)
    rewards = torch.tensor([2.0, 4.0, 6.0, 1.0, 0.0, 0.0])
    adv = compute_advantages(rewards, 3, mask, _cfg(advantage_estimator="rloo"))
    _per_row(adv, mask, [-3.0, 0.0, 3.0, 1.0, -0.5, -0.5])
    with pytest.raises(ValueError, match="rloo needs group_size >= 2"):
        compute_advantages(rewards, 1, mask, _cfg(advantage_estimator="rloo"))


def test_kl_in_reward_shapes_sequence_reward():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.2, 0.2, 5.0], [0.4, 9.0, 9.0]])  # masked entries must not count
    cfg = _cfg(advantage_estimator="dr_grpo", use_kl_in_reward=True, kl_in_reward_coef=0.5)
    # shaped: 1 - 0.5 * 0.4 = 0.8 ; 0 - 0.5 * 0.4 = -0.2 ; mean 0.3
    adv = compute_advantages(torch.tensor([1.0, 0.0]), 2, mask, cfg, kl=kl)
    _per_row(adv, mask, [0.5, -0.5])
    with pytest.raises(ValueError, match="no kl tensor"):
        compute_advantages(torch.tensor([1.0, 0.0]), 2, mask, cfg)


def _whiten(values: list[float]) -> list[float]:
    mu, sd = statistics.mean(values), statistics.stdev(values)
    return [(v - mu) / math.sqrt(sd**2 + 1e-8) for v in values]


def test_reinforce_plus_plus_outcome_only():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = compute_advantages(
        torch.tensor([1.0, 0.0]), 2, mask, _cfg(advantage_estimator="reinforce_plus_plus")
    )
    # returns (gamma 1): row 0 -> [1, 1, 1], row 1 -> [0, 0]; mean 0.6, unbiased var 0.3
    hi, lo = 0.4 / math.sqrt(0.3), -0.6 / math.sqrt(0.3)
    want = torch.tensor([[hi, hi, hi], [lo, lo, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    assert abs(hi - 0.730297) < 1e-5


def test_reinforce_plus_plus_kl_and_discount():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.0, 0.4, 7.0]])
    cfg = _cfg(
        advantage_estimator="reinforce_plus_plus",
        use_kl_in_reward=True,
        kl_in_reward_coef=1.0,
        gamma=0.5,
    )
    adv = compute_advantages(torch.tensor([1.0, 0.0]), 2, mask, cfg, kl=kl)
    # token rewards: row 0 [-0.1, -0.2, -0.3 + 1], row 1 [0, -0.4 + 0]
    # returns: row 0: t2 = 0.7, t1 = -0.2 + 0.35 = 0.15, t0 = -0.1 + 0.075 = -0.025
    #          row 1: t1 = -0.4, t0 = 0 + 0.5 * -0.4 = -0.2
    w = _whiten([-0.025, 0.15, 0.7, -0.2, -0.4])
    want = torch.tensor([[w[0], w[1], w[2]], [w[3], w[4], 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    cfg = _cfg(advantage_estimator="reinforce_plus_plus_baseline")
    adv = compute_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2, mask, cfg)
    # centred per group: [0.5, -0.5, 0, 0]; valid tokens 0.5, 0.5, -0.5, 0, 0, 0
    w = _whiten([0.5, 0.5, -0.5, 0.0, 0.0, 0.0])
    want = torch.tensor([[w[0], w[1]], [w[2], 0.0], [w[3], w[4]], [0.0, w[5]]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_reinforce_plus_plus_baseline_with_kl():
    mask = torch.ones(2, 2)
    kl = torch.tensor([[0.2, 0.0], [0.0, 0.4]])
    cfg = _cfg(
        advantage_estimator="reinforce_plus_plus_baseline",
        use_kl_in_reward=True,
        kl_in_reward_coef=0.5,
    )
    adv = compute_advantages(torch.tensor([1.0, 0.0]), 2, mask, cfg, kl=kl)
    # centred [0.5, -0.5] minus 0.5 * kl per token
    w = _whiten([0.4, 0.5, -0.5, -0.7])
    torch.testing.assert_close(adv, torch.tensor([w[:2], w[2:]]), atol=1e-5, rtol=1e-5)


def test_bad_shapes_and_group_size():
    with pytest.raises(ValueError, match="not a multiple of group_size 4"):
        compute_advantages(torch.zeros(6), 4, torch.ones(6, 2), _cfg())
    with pytest.raises(ValueError, match="expected rewards"):
        compute_advantages(torch.zeros(4), 2, torch.ones(3, 2), _cfg())
