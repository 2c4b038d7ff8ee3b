"""Policy loss variants against values worked out by hand, plus gradient checks."""

from __future__ import annotations

import math

import pytest
import torch

from titan_rl.algo import AlgoConfig, aggregate, kl_penalty, policy_loss


def _lp(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprobs (requiring grad) and old logprobs whose ratios are ``ratios``."""
    old = torch.full((len(ratios), len(ratios[0])), -1.0)
    lp = (old + torch.log(torch.tensor(ratios))).requires_grad_(True)
    return lp, old


def test_ppo_clip_positive_and_negative_advantage():
    lp, old = _lp([[0.5, 1.0, 1.5]])
    mask = torch.ones(1, 3)
    cfg = AlgoConfig(eps_clip=0.2)
    # A = +1: max(-r, -clip(r)) = [-0.5, -1, -1.2]
    loss, m = policy_loss(lp, old, torch.ones(1, 3), mask, cfg)
    assert loss.item() == pytest.approx((-0.5 - 1.0 - 1.2) / 3, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    loss.backward()
    # unclipped tokens: d(-r)/dlp = -r / 3 ; the clipped one (r = 1.5 > 1.2) gets 0
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 3, -1.0 / 3, 0.0]]))

    lp, old = _lp([[0.5, 1.0, 1.5]])
    # A = -1: max(r, clip(r)) = [0.8, 1, 1.5]
    loss, m = policy_loss(lp, old, -torch.ones(1, 3), mask, cfg)
    assert loss.item() == pytest.approx((0.8 + 1.0 + 1.5) / 3, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(1 / 3)
    assert m["ppo_kl"] == pytest.approx(-(math.log(0.5) + math.log(1.5)) / 3, abs=1e-6)
    assert all(isinstance(v, float) for v in m.values())


def test_clip_higher():
    lp, old = _lp([[0.7, 1.5]])
    cfg = AlgoConfig(eps_clip=0.2, eps_clip_high=0.28)
    assert cfg.clip_high == 0.28 and AlgoConfig(eps_clip=0.3).clip_high == 0.3
    loss, _ = policy_loss(lp, old, torch.ones(1, 2), torch.ones(1, 2), cfg)
    # r = 0.7 with A > 0 is not clipped from below: -0.7 ; r = 1.5 -> -1.28
    assert loss.item() == pytest.approx((-0.7 - 1.28) / 2, abs=1e-6)
    loss, _ = policy_loss(lp, old, -torch.ones(1, 2), torch.ones(1, 2), cfg)
    # A < 0: max(r, clip(r, 0.8, 1.28)) = [0.8, 1.5]
    assert loss.item() == pytest.approx((0.8 + 1.5) / 2, abs=1e-6)


def test_dual_clip_caps_negative_advantage_and_zeroes_gradient():
    lp, old = _lp([[5.0, 2.0, 5.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    cfg = AlgoConfig(eps_clip=0.2, eps_clip_c=3.0)
    loss, m = policy_loss(lp, old, adv, torch.ones(1, 3), cfg)
    # tok0: min(3, max(5, 1.2)) = 3 ; tok1: min(3, 2) = 2 ; tok2 (A > 0): max(-5, -1.2) = -1.2
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-6)
    assert m["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    loss.backward()
    # only tok1 is live: d(r)/dlp = r = 2, over 3 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]))
    # without dual clip tok0 would contribute 5 and a gradient
    lp2, _ = _lp([[5.0, 2.0, 5.0]])
    loss2, _ = policy_loss(lp2, old, adv, torch.ones(1, 3), AlgoConfig(eps_clip=0.2))
    assert loss2.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3, abs=1e-6)


def test_gspo_sequence_ratio_with_straight_through_gradient():
    old = torch.tensor([[-1.0, -2.0, -3.0, -1.0]])
    lp = (old + torch.tensor([[0.1, 0.2, 0.3, 9.0]])).requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the masked 9.0 must not enter the mean
    cfg = AlgoConfig(advantage_estimator="gspo", eps_clip=0.5)
    loss, m = policy_loss(lp, old, torch.ones(1, 4), mask, cfg)
    s = math.exp(0.2)  # exp(mean(0.1, 0.2, 0.3))
    assert loss.item() == pytest.approx(-s, abs=1e-6)
    assert m["ratio_mean"] == pytest.approx(s, abs=1e-6)
    loss.backward()
    # every token's gradient is the sequence ratio (not its own token ratio), / 3 tokens
    torch.testing.assert_close(lp.grad, torch.tensor([[-s / 3, -s / 3, -s / 3, 0.0]]))


def test_gspo_clips_the_whole_sequence():
    old = torch.zeros(2, 2)
    lp = torch.tensor([[0.1, 0.3], [-0.05, 0.05]], requires_grad=True)
    cfg = AlgoConfig(advantage_estimator="gspo", eps_clip=0.1)
    loss, m = policy_loss(lp, old, torch.ones(2, 2), torch.ones(2, 2), cfg)
    # row 0: exp(mean(0.1, 0.3)) = exp(0.2) = 1.221 > 1.1 -> clipped to 1.1 on both tokens,
    # although token 0's own ratio exp(0.1) is inside the range ; row 1: exp(0) = 1
    assert loss.item() == pytest.approx((-1.1 * 2 - 1.0 * 2) / 4, abs=1e-6)
    assert m["pg_clipfrac"] == pytest.approx(0.5)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, 0.0], [-0.25, -0.25]]))


X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]])
XMASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "want"),
    [
        ("token_mean", (1 + 2 + 3 + 4) / 4),
        ("seq_mean_token_mean", (2.0 + 4.0) / 2),
        ("seq_mean_token_sum", (6.0 + 4.0) / 2),
    ],
)
def test_aggregation_modes(mode: str, want: float):
    assert aggregate(X, XMASK, mode).item() == pytest.approx(want)
    # with ratio 1 the per-token loss is -A, so the loss is -aggregate(A)
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = policy_loss(lp, lp.detach(), X, XMASK, AlgoConfig(loss_agg_mode=mode))
    assert loss.item() == pytest.approx(-want)


def test_empty_rows_do_not_count_as_sequences():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    x = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    assert aggregate(x, mask, "seq_mean_token_mean").item() == pytest.approx(3.0)
    assert aggregate(x, mask, "seq_mean_token_sum").item() == pytest.approx(6.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_microbatches_with_global_counts_sum_to_full_batch(mode: str):
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=g)
    lp_full = (old + 0.3 * torch.randn(4, 5, generator=g)).requires_grad_(True)
    adv = torch.randn(4, 5, generator=g)
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.float32
    )
    cfg = AlgoConfig(loss_agg_mode=mode, eps_clip_c=3.0)
    full, _ = policy_loss(lp_full, old, adv, mask, cfg)
    full.backward()
    lp_mb = lp_full.detach().clone().requires_grad_(True)
    total = torch.zeros(())
    for sl in (slice(0, 1), slice(1, 4)):
        part, _ = policy_loss(
            lp_mb[sl], old[sl], adv[sl], mask[sl], cfg, total_tokens=13.0, total_seqs=4
        )
        part.backward()
        total = total + part.detach()
    assert total.item() == pytest.approx(full.item(), abs=1e-6)
    torch.testing.assert_close(lp_mb.grad, lp_full.grad)


def test_global_count_must_match_the_mode():
    with pytest.raises(ValueError, match="needs total_seqs"):
        aggregate(X, XMASK, "seq_mean_token_mean", total_tokens=4.0)
    with pytest.raises(ValueError, match="needs total_tokens"):
        aggregate(X, XMASK, "token_mean", total_seqs=2)
    # the unused count may be given too
    assert aggregate(X, XMASK, "token_mean", total_tokens=8.0, total_seqs=2).item() == 1.25


def test_kl_penalty_kinds():
    lp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    torch.testing.assert_close(kl_penalty(lp, ref, "k1"), torch.tensor([0.5, -1.0]))
    torch.testing.assert_close(kl_penalty(lp, ref, "k2"), torch.tensor([0.125, 0.5]))
    # k3: exp(ref - lp) - (ref - lp) - 1 with ref - lp = [-0.5, 1]
    k3 = torch.tensor([math.exp(-0.5) + 0.5 - 1, math.e - 2])
    torch.testing.assert_close(kl_penalty(lp, ref, "k3"), k3)
    torch.testing.assert_close(kl_penalty(lp, ref, "low_var_kl"), k3)
    # far apart: k3 = e^3 - 4 = 16.09, low_var_kl clamps to 10; ref - lp = 30 clamps first
    far = kl_penalty(torch.tensor([0.0, 0.0]), torch.tensor([3.0, 30.0]), "low_var_kl")
    torch.testing.assert_close(far, torch.tensor([10.0, 10.0]))
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([3.0]), "k3").item() == pytest.approx(
        math.exp(3) - 4, rel=1e-6
    )


def test_kl_loss_and_entropy_bonus():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    ent = torch.tensor([[0.5, 1.5]])
    adv = torch.tensor([[1.0, -1.0]])
    cfg = AlgoConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1", entropy_coef=0.01)
    loss, m = policy_loss(
        lp, lp.detach(), adv, torch.ones(1, 2), cfg, ref_logprobs=ref, entropy=ent
    )
    # pg: (-1 + 1) / 2 = 0 ; kl k1 mean (0.5 - 1) / 2 = -0.25 ; entropy mean 1.0
    assert loss.item() == pytest.approx(0.0 + 0.1 * -0.25 - 0.01 * 1.0, abs=1e-6)
    assert m["kl_loss"] == pytest.approx(-0.25) and m["entropy"] == pytest.approx(1.0)
    loss.backward()
    # d/dlp: pg -A * r / 2 (r = 1) plus 0.1 * 1 / 2 from k1
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 + 0.05, 0.5 + 0.05]]))
    with pytest.raises(ValueError, match="no ref_logprobs"):
        policy_loss(lp, lp.detach(), adv, torch.ones(1, 2), cfg, entropy=ent)
    with pytest.raises(ValueError, match="no entropy"):
        policy_loss(lp, lp.detach(), adv, torch.ones(1, 2), cfg, ref_logprobs=ref)


def test_truncated_importance_sampling():
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    lp = old.clone().requires_grad_(True)
    rollout = old - torch.log(torch.tensor([[0.5, 3.0, 1.0]]))  # old - rollout = log w
    cfg = AlgoConfig(use_tis=True, tis_clip=2.0)
    loss, m = policy_loss(
        lp, old, torch.ones(1, 3), torch.ones(1, 3), cfg, rollout_logprobs=rollout
    )
    # per-token -1 weighted by min(w, 2) = [0.5, 2, 1]
    assert loss.item() == pytest.approx(-(0.5 + 2.0 + 1.0) / 3, abs=1e-6)
    assert m["tis_mean"] == pytest.approx((0.5 + 3.0 + 1.0) / 3, abs=1e-6)
    assert m["tis_clipfrac"] == pytest.approx(1 / 3)
    assert m["train_rollout_logprob_abs_diff"] == pytest.approx(
        (math.log(2) + math.log(3)) / 3, abs=1e-6
    )
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.5 / 3, -2.0 / 3, -1.0 / 3]]))
    with pytest.raises(ValueError, match="no rollout_logprobs"):
        policy_loss(lp, old, torch.ones(1, 3), torch.ones(1, 3), cfg)
