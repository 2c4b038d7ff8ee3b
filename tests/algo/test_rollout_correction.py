"""TIS / MIS / IcePop weights and masks against hand-computed cases, the mismatch measurements
against a direct float64 computation, and what the corrections do to the loss and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from titan_rl.algo import AlgoConfig, policy_loss
from titan_rl.algo.rollout_correction import mismatch_metrics, rollout_correction

LN = math.log


def _rollout(old: torch.Tensor, ratios: list[list[float]]) -> torch.Tensor:
    """Rollout logprobs whose token ratios exp(old - rollout) are ``ratios`` (float64 with
    old = 0, so a ratio on a bound is exactly on it)."""
    return old - torch.tensor([[LN(r) for r in row] for row in ratios], dtype=torch.float64)


# one row, ratios 0.25 .. 4: the bounds 0.5 and 2 sit exactly on two of them
OLD = torch.zeros(1, 5, dtype=torch.float64)
ROLL = _rollout(OLD, [[0.25, 0.5, 1.0, 2.0, 4.0]])
ONES = torch.ones(1, 5, dtype=torch.float64)


def test_token_tis_truncates_to_the_clip_range():
    c = rollout_correction(OLD, ROLL, ONES, AlgoConfig(use_tis=True, tis_clip=2.0))
    torch.testing.assert_close(c.weight, torch.tensor([[0.25, 0.5, 1.0, 2.0, 2.0]]).double())
    assert c.stats["tis_clipfrac"].item() == pytest.approx(1 / 5)
    assert c.stats["tis_mean"].item() == pytest.approx((0.25 + 0.5 + 1 + 2 + 4) / 5)
    assert c.mask.equal(ONES) and not c.dropped.any()
    cfg = AlgoConfig(use_tis=True, tis_clip=2.0, tis_clip_low=0.5)
    c = rollout_correction(OLD, ROLL, ONES, cfg)
    torch.testing.assert_close(c.weight, torch.tensor([[0.5, 0.5, 1.0, 2.0, 2.0]]).double())
    assert c.stats["tis_clipfrac"].item() == pytest.approx(2 / 5)


def test_token_mis_drops_tokens_outside_the_inclusive_bounds():
    cfg = AlgoConfig(use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0)
    c = rollout_correction(OLD, ROLL, ONES, cfg)
    assert c.mask.tolist() == [[0.0, 1.0, 1.0, 1.0, 0.0]]  # 0.5 and 2 are kept
    assert c.dropped.tolist() == [[True, False, False, False, True]]
    assert c.weight.equal(torch.ones_like(c.weight))  # MIS only masks
    # rs_lower_bound unset: 1 / rs_upper_bound (= 0.25 here, which is kept)
    c = rollout_correction(OLD, ROLL, ONES, AlgoConfig(use_rs=True, rs_upper_bound=4.0))
    assert c.mask.tolist() == [[1.0] * 5]
    # a hair past a bound is outside
    past = _rollout(OLD, [[0.5 * (1 - 1e-9), 2.0 * (1 + 1e-9), 1.0, 1.0, 1.0]])
    assert rollout_correction(OLD, past, ONES, cfg).mask.tolist() == [[0, 0, 1, 1, 1]]


def test_icepop_zeroes_tokens_outside_alpha_beta_and_keeps_them_in_the_mask():
    cfg = AlgoConfig(use_icepop=True, icepop_alpha=0.5, icepop_beta=2.0)
    c = rollout_correction(OLD, ROLL, ONES, cfg)
    # inside [alpha, beta] (bounds included) the weight is the ratio itself, outside 0
    torch.testing.assert_close(c.weight, torch.tensor([[0.0, 0.5, 1.0, 2.0, 0.0]]).double())
    assert c.mask.equal(ONES)  # the normaliser keeps every token
    assert c.dropped.tolist() == [[True, False, False, False, True]]
    # IcePop replaces TIS when the GRPO loop switches TIS on for async rollouts
    both = cfg.model_copy(update={"use_tis": True, "tis_clip": 1.0})
    assert rollout_correction(OLD, ROLL, ONES, both).weight.equal(c.weight)


# two rows, the last positions off the mask with a wild ratio that must not count:
# row 0 ratios 2, 2, 0.5 -> product 2, geometric mean 2 ** (1/3); row 1: 4, 4 -> 16 and 4
SEQ_OLD = torch.zeros(2, 4, dtype=torch.float64)
SEQ_ROLL = _rollout(SEQ_OLD, [[2.0, 2.0, 0.5, 1e6], [4.0, 4.0, 1e6, 1e6]])
SEQ_MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize(
    ("level", "row0", "row1"),
    [("token", [2.0, 2.0, 0.5], [3.0, 3.0]), ("sequence", [2.0] * 3, [3.0] * 2),
     ("geometric", [2 ** (1 / 3)] * 3, [3.0] * 2)],
)  # fmt: skip
def test_tis_levels(level: str, row0: list[float], row1: list[float]):
    cfg = AlgoConfig(use_tis=True, tis_clip=3.0, tis_level=level)
    w = rollout_correction(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg).weight
    torch.testing.assert_close(w[0, :3], torch.tensor(row0).double())
    torch.testing.assert_close(w[1, :2], torch.tensor(row1).double())


@pytest.mark.parametrize(
    ("level", "high", "kept"),
    [
        ("token", 2.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),  # the 4s go, 2 and 0.5 are on the bounds
        ("sequence", 2.0, [[1, 1, 1, 0], [0, 0, 0, 0]]),  # 2 is on the bound, 16 is out
        ("sequence", 1.9, [[0, 0, 0, 0], [0, 0, 0, 0]]),
        ("geometric", 4.0, [[1, 1, 1, 0], [1, 1, 0, 0]]),  # 1.26 and 4 (on the bound) stay
        ("geometric", 1.25, [[0, 0, 0, 0], [0, 0, 0, 0]]),  # 2 ** (1/3) = 1.2599 is out
        ("geometric", 1.26, [[1, 1, 1, 0], [0, 0, 0, 0]]),
    ],
)
def test_mis_levels_drop_tokens_or_whole_sequences(level: str, high: float, kept: list):
    cfg = AlgoConfig(use_rs=True, rs_level=level, rs_lower_bound=0.5, rs_upper_bound=high)
    c = rollout_correction(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg)
    assert c.mask.tolist() == kept
    want_dropped = (SEQ_MASK.bool() & ~torch.tensor(kept).bool()).tolist()
    assert c.dropped.tolist() == want_dropped


def test_mis_lower_bound_drops_low_ratios_by_level():
    cfg = AlgoConfig(use_rs=True, rs_level="token", rs_lower_bound=0.6, rs_upper_bound=5.0)
    assert rollout_correction(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg).mask[0].tolist() == [1, 1, 0, 0]
    cfg = cfg.model_copy(update={"rs_level": "geometric"})  # row 0's mean 1.26 is above 0.6
    assert rollout_correction(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg).mask[0].tolist() == [1, 1, 1, 0]


def test_mismatch_metrics_against_a_direct_float64_computation():
    g = torch.Generator().manual_seed(1234)
    old = -3 * torch.rand(6, 9, generator=g)  # float32, as the trainer hands them
    # small and large gaps: k3 of a 1e-4 log-ratio cancels in float32
    scale = torch.tensor([1e-4, 1e-3, 1e-2, 0.1, 0.5, 1.0]).unsqueeze(1)
    rollout = old + scale * torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.3).float()
    rollout[mask == 0] = 0.0  # off the response, as RLBatch pads it

    got = mismatch_metrics(old, rollout, mask, AlgoConfig())
    d = old.double() - rollout.double()
    on = mask.bool()
    k3 = torch.exp(d) - d - 1
    assert got["mismatch/kl"] == pytest.approx(k3[on].mean().item(), rel=1e-9)
    assert got["mismatch/logprob_abs_diff_mean"] == pytest.approx(d[on].abs().mean().item())
    assert got["mismatch/logprob_abs_diff_max"] == pytest.approx(d[on].abs().max().item())
    assert got["mismatch/ratio_mean"] == pytest.approx(torch.exp(d[on]).mean().item())
    assert got["mismatch/masked_share"] == 0.0  # every switch off: nothing masked
    # k3 is KL(rollout || trainer): it weighs the trainer's ratio, not the rollout's
    reverse = torch.exp(-d) + d - 1
    assert got["mismatch/kl"] != pytest.approx(reverse[on].mean().item(), rel=1e-3)
    # the small-gap row on its own, where float32 arithmetic would be far off
    row = mismatch_metrics(old[:1], rollout[:1], mask[:1], AlgoConfig())["mismatch/kl"]
    assert row == pytest.approx(k3[:1][on[:1]].mean().item(), rel=1e-6)


def test_masked_share_counts_mis_and_icepop_over_valid_tokens():
    cfg = AlgoConfig(use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0)
    assert mismatch_metrics(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg)["mismatch/masked_share"] == 2 / 5
    cfg = AlgoConfig(use_icepop=True, icepop_alpha=0.6, icepop_beta=5.0)  # pops the 0.5
    assert mismatch_metrics(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg)["mismatch/masked_share"] == 1 / 5
    cfg = cfg.model_copy(update={"use_rs": True, "rs_upper_bound": 2.0})  # both: the union
    assert mismatch_metrics(SEQ_OLD, SEQ_ROLL, SEQ_MASK, cfg)["mismatch/masked_share"] == 3 / 5
    empty = mismatch_metrics(SEQ_OLD, SEQ_ROLL, torch.zeros_like(SEQ_MASK), cfg)
    assert set(empty.values()) == {0.0}


def _loss_inputs() -> tuple[torch.Tensor, ...]:
    old = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.7, -1.2, -2.0, -0.3]])
    lp = (old + torch.tensor([[0.1, -0.2, 0.05, 0.0], [0.0, 0.15, -0.1, 0.2]])).requires_grad_()
    rollout = old - torch.log(torch.tensor([[1.0, 3.0, 1.5, 0.2], [1.2, 0.9, 1.0, 1.1]]))
    adv = torch.tensor([[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    return lp, old, rollout, adv, mask


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
def test_mis_tokens_leave_the_loss_its_normaliser_and_the_gradient(mode: str):
    lp, old, rollout, adv, mask = _loss_inputs()
    ref = old - 0.3
    ent = torch.rand(2, 4)
    kw = {"loss_agg_mode": mode, "use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coef": 0.01}
    cfg = AlgoConfig(use_rs=True, rs_lower_bound=0.5, rs_upper_bound=2.0, **kw)
    loss, m = policy_loss(
        lp, old, adv, mask, cfg, rollout_logprobs=rollout, ref_logprobs=ref, entropy=ent
    )
    loss.backward()
    # ratios 3 and 0.2 are out: the same loss as without them in the mask at all
    kept = torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    lp2 = lp.detach().clone().requires_grad_()
    want, _ = policy_loss(lp2, old, adv, kept, AlgoConfig(**kw), ref_logprobs=ref, entropy=ent)
    want.backward()
    assert loss.item() == pytest.approx(want.item(), abs=1e-7)
    torch.testing.assert_close(lp.grad, lp2.grad)
    assert lp.grad[0, 1] == 0 and lp.grad[0, 3] == 0 and lp.grad[0, 0] != 0
    # the global counts a caller passes are those of the kept tokens
    cut = rollout_correction(old, rollout, mask, cfg).mask
    assert cut.equal(kept)
    tot, _ = policy_loss(
        lp.detach(), old, adv, mask, cfg, rollout_logprobs=rollout, ref_logprobs=ref,
        entropy=ent, total_tokens=float(cut.sum()), total_seqs=2,
    )  # fmt: skip
    assert tot.item() == pytest.approx(want.item(), abs=1e-7)


def test_sequence_mis_drops_the_whole_sequence():
    lp, old, rollout, adv, mask = _loss_inputs()
    # row 0: geometric mean of 1, 3, 1.5, 0.2 = 0.9457 ; row 1: of 1.2, 0.9, 1.0 = 1.026
    cfg = AlgoConfig(use_rs=True, rs_level="geometric", rs_lower_bound=1.0, rs_upper_bound=1.1)
    loss, _ = policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    loss.backward()
    assert lp.grad[0].abs().sum() == 0 and lp.grad[1, :3].abs().min() > 0
    # token_mean over row 1's 3 tokens: -A * r_t / 3 with A = -0.5
    r = torch.exp(lp.detach()[1, :3] - old[1, :3])
    torch.testing.assert_close(lp.grad[1, :3], 0.5 * r / 3)


def test_icepop_zeroes_the_gradient_but_keeps_the_normaliser():
    lp, old, rollout, adv, mask = _loss_inputs()
    cfg = AlgoConfig(use_icepop=True, icepop_alpha=0.5, icepop_beta=2.0, eps_clip=0.5)
    loss, _ = policy_loss(lp, old, adv, mask, cfg, rollout_logprobs=rollout)
    loss.backward()
    w = torch.tensor([[1.0, 0.0, 1.5, 0.0], [1.2, 0.9, 1.0, 0.0]])  # 3 and 0.2 popped
    r = torch.exp(lp.detach() - old)  # inside the PPO clip range here
    assert loss.item() == pytest.approx(((-adv * r * w) * mask).sum().item() / 7, abs=1e-6)
    torch.testing.assert_close(lp.grad, -adv * r * w * mask / 7)
    assert lp.grad[0, 1] == 0 and lp.grad[0, 3] == 0


def test_no_rollout_logprobs_is_an_error_for_every_switch():
    lp, old, _, adv, mask = _loss_inputs()
    for key in ("use_tis", "use_rs", "use_icepop"):
        with pytest.raises(ValueError, match=f"algo.{key} is true but no rollout_logprobs"):
            policy_loss(lp, old, adv, mask, AlgoConfig(**{key: True}))


def _dp_rank(rank: int, init: str, out: dict) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        rows = slice(rank * 3, rank * 3 + 3)
        old, rollout, mask, cfg = _dp_batch()
        out[rank] = mismatch_metrics(
            old[rows], rollout[rows], mask[rows], cfg, group=dist.group.WORLD
        )
    finally:
        dist.destroy_process_group()


def _dp_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AlgoConfig]:
    g = torch.Generator().manual_seed(7)
    old = -2 * torch.rand(6, 5, generator=g)
    rollout = old + 0.3 * torch.randn(6, 5, generator=g)
    mask = torch.ones(6, 5)
    mask[1, 2:] = 0  # rows of different lengths, so a mean of rank means would be off
    mask[4, 1:] = 0
    rollout[3, 4] = old[3, 4] - 3.0  # the largest gap sits on rank 1
    return old, rollout, mask, AlgoConfig(use_rs=True, rs_upper_bound=1.3)


def test_mismatch_metrics_pool_the_data_parallel_ranks(tmp_path):
    """Each rank's record is the whole batch's (sums and max over the DP group)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_dp_rank, args=(f"file://{tmp_path / 'store'}", out), nprocs=2)
        got = dict(out)
    whole = mismatch_metrics(*_dp_batch())
    assert whole["mismatch/logprob_abs_diff_max"] == pytest.approx(3.0, rel=1e-6)
    assert 0 < whole["mismatch/masked_share"] < 1
    for rank in (0, 1):
        assert got[rank].keys() == whole.keys()
        for key, value in whole.items():
            assert got[rank][key] == pytest.approx(value, rel=1e-12), key
