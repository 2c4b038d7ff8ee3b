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


def test_returns_run_through_masked_positions_inside_a_response():
    """A multi-turn mask (a tool's reply masked out): the outcome reward reaches the tokens
    before the reply; masked positions keep no return."""
    from titan_rl.algo.advantages import discounted_returns

    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    got = discounted_returns(rewards, mask, gamma=1.0)
    torch.testing.assert_close(got, torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]]))
    got = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(got, torch.tensor([[1 / 16, 1 / 8, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_returns_match_slimes_implementation(gamma):
    """The same returns as slime's own ``chunked_discounted_returns`` on the valid tokens
    (random rewards, masks with gaps and right padding)."""
    ppo_utils = pytest.importorskip("slime.utils.ppo_utils", reason="slime's wheel is needed")
    from titan_rl.algo.advantages import discounted_returns

    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 40, generator=g) > 0.3).float()
    mask[:, 30:] = 0.0  # right padding
    rewards = torch.randn(6, 40, generator=g) * mask
    want = ppo_utils.chunked_discounted_returns(rewards, gamma) * mask
    torch.testing.assert_close(discounted_returns(rewards, mask, gamma), want)


#: the rows each of two DP ranks holds (rank r: rows[r] to rows[r + 1])
SPLITS = {"rows0": [0, 4, 8], "rows1": [0, 2, 8]}


def _whiten_on_ranks(rank: int, world: int, init: str, splits: list[list[int]], out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rewards, mask, kl, cfgs = _whiten_case()
    for i, rows in enumerate(splits):
        mine = slice(rows[rank], rows[rank + 1])
        got = [
            compute_advantages(
                rewards[mine], 2, mask[mine], cfg, kl=kl[mine], group=dist.group.WORLD
            )
            for cfg in cfgs
        ]
        torch.save(got, f"{out}.{i}.{rank}")
    dist.destroy_process_group()


def _whiten_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[AlgoConfig]]:
    g = torch.Generator().manual_seed(3)
    rewards = torch.rand(8, generator=g)
    mask = (torch.rand(8, 12, generator=g) > 0.25).float()
    kl = torch.rand(8, 12, generator=g) * 0.1
    cfgs = [
        _cfg(advantage_estimator=est, use_kl_in_reward=True, kl_in_reward_coef=0.2, gamma=0.95)
        for est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline")
    ]
    return rewards, mask, kl, cfgs


@pytest.fixture(scope="module")
def whitened_on_ranks(tmp_path_factory) -> dict[str, list[list[torch.Tensor]]]:
    """Each split's advantages from its two gloo ranks ([rank][estimator]): one pair of
    spawned processes for every split."""
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("whiten")
    out = str(tmp / "adv")
    init = f"file://{tmp / 'store'}"
    mp.spawn(_whiten_on_ranks, args=(2, init, list(SPLITS.values()), out), nprocs=2, join=True)
    return {name: [torch.load(f"{out}.{i}.{r}") for r in range(2)] for i, name in enumerate(SPLITS)}


@pytest.mark.parametrize("split", list(SPLITS))
def test_whitening_over_dp_ranks_equals_the_whole_batch(whitened_on_ranks, split):
    """REINFORCE++ advantages of rows split over two DP ranks (gloo) equal those of the whole
    batch in one process: the whitening statistics are the batch's, not each rank's."""
    rewards, mask, kl, cfgs = _whiten_case()
    parts = whitened_on_ranks[split]
    for i, cfg in enumerate(cfgs):
        whole = compute_advantages(rewards, 2, mask, cfg, kl=kl)
        split_adv = torch.cat([parts[0][i], parts[1][i]])
        torch.testing.assert_close(split_adv, whole, atol=1e-6, rtol=1e-6)
        alone = compute_advantages(rewards[:4], 2, mask[:4], cfg, kl=kl[:4])
        assert not torch.allclose(alone, whole[:4], atol=1e-3)  # per-rank stats would differ
