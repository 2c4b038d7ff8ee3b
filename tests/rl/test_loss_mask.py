"""``Sample.loss_mask``: response tokens fed to the model but not trained (a tool's reply)
carry no loss, no entropy or KL term, and no weight in the rollout correction or the
mismatch record, whatever their rollout logprob."""

from __future__ import annotations

import pytest
import torch

from titan_rl.algo.advantages import compute_advantages
from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.losses import policy_loss
from titan_rl.algo.rollout_correction import mismatch_metrics
from titan_rl.sample import Sample, Status
from titan_rl.trainer.batch import pack_samples


def _samples(gen: torch.Generator) -> list[Sample]:
    """Four samples of random lengths, each with a random loss mask (first token trained)."""
    out = []
    for i in range(4):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        r = int(torch.randint(4, 12, (1,), generator=gen))
        mask = (torch.rand(r, generator=gen) < 0.6).int().tolist()
        mask[0] = 1
        lps = [-float(torch.rand(1, generator=gen)) if m else 0.0 for m in mask]
        out.append(
            Sample(
                group_index=i // 2,
                index=i % 2,
                prompt="",
                label="",
                prompt_tokens=torch.randint(3, 50, (p,), generator=gen).tolist(),
                response_tokens=torch.randint(3, 50, (r,), generator=gen).tolist(),
                rollout_log_probs=lps,
                loss_mask=mask,
                reward=float(i % 3),
                status=Status.COMPLETED,
            )  # fmt: skip
        )
    return out


def _compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's trained positions, moved to the front (the rest padded, mask 0)."""
    out, keep = torch.zeros_like(x), torch.zeros_like(mask)
    for i in range(x.shape[0]):
        cols = mask[i].bool()
        n = int(cols.sum())
        out[i, :n], keep[i, :n] = x[i, cols], 1.0
    return out, keep


def test_pack_puts_the_loss_mask_on_the_response_positions() -> None:
    s = Sample(0, 0, "", [5, 6, 7], "", response_tokens=[8, 9, 10, 11],
               rollout_log_probs=[-0.1, 0.0, 0.0, -0.4], loss_mask=[1, 0, 0, 1])  # fmt: skip
    plain = Sample(0, 1, "", [5], "", response_tokens=[8, 9], rollout_log_probs=[-0.2, -0.3])
    batch = pack_samples([s, plain], pad_id=0)
    assert batch.tokens[0, :7].tolist() == [5, 6, 7, 8, 9, 10, 11]  # every token is fed
    assert batch.response_mask[0].tolist() == [0, 0, 1, 0, 0, 1, 0]
    assert batch.response_mask[1].tolist() == [1, 1, 0, 0, 0, 0, 0]  # None: all trained
    assert batch.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, 0, 0, -0.4, 0])


@pytest.mark.parametrize("mask", [[1, 0], [1, 0, 2]])
def test_pack_refuses_a_loss_mask_that_does_not_fit(mask: list[int]) -> None:
    s = Sample(1, 2, "", [5], "", response_tokens=[8, 9, 10], loss_mask=mask)
    with pytest.raises(ValueError, match="sample 1/2: loss_mask must hold one 0 or 1"):
        pack_samples([s], pad_id=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_loss_and_mismatch_equal_those_of_the_trained_tokens_alone(seed: int, agg: str) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = pack_samples(_samples(gen), pad_id=0)
    mask = batch.response_mask
    shape = mask.shape
    old = batch.rollout_logprobs + 0.05 * torch.randn(shape, generator=gen)  # near the rollout
    lp = old + 0.1 * torch.randn(shape, generator=gen)
    ref = old + 0.1 * torch.randn(shape, generator=gen)
    ent = torch.rand(shape, generator=gen)
    cfg = AlgoConfig(
        loss_agg_mode=agg, use_tis=True, use_rs=True, rs_upper_bound=1.1, use_kl_loss=True,
        kl_loss_coef=0.1, entropy_coef=0.01,
    )  # fmt: skip
    adv = compute_advantages(batch.rewards, 2, mask, cfg)
    assert (adv[mask == 0] == 0).all()

    def loss(m: torch.Tensor, *t: torch.Tensor) -> tuple[float, dict[str, float]]:
        lp_, old_, adv_, roll_, ref_, ent_ = t
        value, stats = policy_loss(
            lp_, old_, adv_, m, cfg, rollout_logprobs=roll_, ref_logprobs=ref_, entropy=ent_
        )
        return float(value), stats

    fields = (lp, old, adv, batch.rollout_logprobs, ref, ent)
    compact = [_compact(t, mask)[0] for t in fields]
    keep = _compact(lp, mask)[1]
    full_loss, full_stats = loss(mask, *fields)
    only_loss, only_stats = loss(keep, *compact)
    assert full_loss == pytest.approx(only_loss, rel=1e-5, abs=1e-7)
    for k in ("pg_loss", "kl_loss", "entropy", "tis_mean", "ppo_kl"):
        assert full_stats[k] == pytest.approx(only_stats[k], rel=1e-5, abs=1e-7), k
    full_mm = mismatch_metrics(old, batch.rollout_logprobs, mask, cfg)
    only_mm = mismatch_metrics(compact[1], compact[3], keep, cfg)
    assert full_mm == pytest.approx(only_mm, rel=1e-6)
    # counted, the masked tokens' rollout logprobs (0) would change the record
    samples = _samples(torch.Generator().manual_seed(seed))
    for x in samples:
        x.loss_mask = None
    unmasked = pack_samples(samples, pad_id=0).response_mask
    assert mismatch_metrics(old, batch.rollout_logprobs, unmasked, cfg) != full_mm
