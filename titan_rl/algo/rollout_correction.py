"""Train / rollout mismatch: its per-step measurements and the corrections TIS, MIS, IcePop.

A token's importance ratio is ``exp(old_lp - rollout_lp)``: the trainer's probability of the
sampled token (before this step's updates) over the rollout engine's. Shapes as in
``losses``: ``[B, T]`` over response positions, ``mask`` 1 on the tokens that count. Nothing
here carries a gradient. Bounds are inclusive and compared in log space, as verl does, so a
ratio exactly at a bound is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from titan_rl.algo.config import AlgoConfig, CorrectionLevel

#: log-ratios are clamped to +-20 before exp() so one bad token cannot overflow (verl and
#: slime's SAFETY_BOUND; the PPO ratio in losses too).
LOG_RATIO_CLAMP = 20.0


@dataclass(frozen=True)
class Correction:
    """What the switched-on corrections do to one batch's policy-gradient loss."""

    #: per-token factor on the policy-gradient term (1 where no correction applies).
    weight: Tensor
    #: the loss mask without the tokens MIS dropped: the loss normaliser counts these only.
    mask: Tensor
    #: valid tokens taken out of the update, by MIS or IcePop (bool).
    dropped: Tensor
    #: TIS statistics (means over the valid tokens), when TIS is on.
    stats: dict[str, Tensor]


def level_log_ratio(log_ratio: Tensor, mask: Tensor, level: CorrectionLevel) -> Tensor:
    """The log-ratio at ``level`` on every position: the token's own, its sequence's sum
    (the log of the product of ratios) or its sequence's mean over valid tokens (the log of
    the geometric mean)."""
    if level == "token":
        return log_ratio
    valid = mask.bool()
    total = torch.where(valid, log_ratio, 0.0).sum(dim=1, keepdim=True)
    if level == "geometric":
        total = total / valid.sum(dim=1, keepdim=True).clamp(min=1)
    elif level != "sequence":
        raise ValueError(f"unknown correction level {level!r} (token, sequence, geometric)")
    return total.expand_as(log_ratio)


def _ratio(log_ratio: Tensor) -> Tensor:
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _inside(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """``low <= exp(log_ratio) <= high``, in log space (a ratio on a bound is inside)."""
    log_low = math.log(low) if low > 0.0 else -math.inf
    return (log_ratio >= log_low) & (log_ratio <= math.log(high))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    valid = mask.bool()
    return torch.where(valid, x, 0.0).sum() / valid.sum().clamp(min=1)


def rollout_correction(
    old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, cfg: AlgoConfig
) -> Correction:
    """The weights and masks of the corrections ``cfg`` switches on.

    TIS (``use_tis``): weight ``clip(ratio, tis_clip_low, tis_clip)`` with the ratio at
    ``tis_level``. IcePop (``use_icepop``): weight ``ratio`` where the token ratio is in
    [icepop_alpha, icepop_beta], else 0; the token stays in the normaliser, as in slime's
    ``icepop_function``; it replaces TIS. MIS (``use_rs``): tokens, or whole sequences, whose
    ratio at ``rs_level`` is outside ``rs_bounds`` leave the loss mask, as verl's
    ``rollout_rs`` rewrites ``response_mask``.
    """
    log_ratio = (old_logprobs - rollout_logprobs).detach()
    valid = mask.bool()
    weight = torch.ones_like(log_ratio)
    popped = torch.zeros_like(valid)
    stats: dict[str, Tensor] = {}
    if cfg.use_icepop:
        inside = _inside(log_ratio, cfg.icepop_alpha, cfg.icepop_beta)
        weight = torch.where(inside, _ratio(log_ratio), torch.zeros_like(log_ratio))
        popped = valid & ~inside
    elif cfg.use_tis:
        tis = _ratio(level_log_ratio(log_ratio, mask, cfg.tis_level))
        weight = tis.clamp(min=cfg.tis_clip_low, max=cfg.tis_clip)
        stats["tis_mean"] = _masked_mean(tis, mask)
        stats["tis_clipfrac"] = _masked_mean((weight != tis).to(tis.dtype), mask)
    keep = valid
    if cfg.use_rs:
        low, high = cfg.rs_bounds
        keep = valid & _inside(level_log_ratio(log_ratio, mask, cfg.rs_level), low, high)
    return Correction(weight, keep.to(mask.dtype), (valid & ~keep) | popped, stats)


def mismatch_metrics(
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    cfg: AlgoConfig,
    *,
    group: Any = None,
    device: torch.device | None = None,
    dropped: Tensor | None = None,
) -> dict[str, float]:
    """The step's ``mismatch/*`` record, whatever the switches (they are measurements).

    ``logprob_abs_diff_mean|max``: ``|old_lp - rollout_lp|`` over valid tokens; ``kl``: the
    k3 estimate of KL(rollout || trainer), ``r - log r - 1`` with ``r`` the token ratio
    (the tokens were sampled by the rollout), a token mean (slime's ``k3_kl``);
    ``ratio_mean``: the token ratio's mean; ``masked_share``: the share of valid tokens MIS
    or IcePop take out of the update (0 with both off). Computed in float64 (k3 of a small
    log-ratio cancels in float32). ``group``: the data-parallel group whose ranks hold the
    batch's other rows, so every rank reports the whole batch's values; ``device``: where
    that collective runs; ``dropped``: the tokens :func:`rollout_correction` takes out, when
    the caller already has them (computed here otherwise).
    """
    valid = mask.bool()
    diff = old_logprobs.detach().double() - rollout_logprobs.detach().double()
    log_ratio = torch.where(valid, diff, 0.0)
    clamped = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.where(valid, torch.exp(clamped), 0.0)
    k3 = ratio - clamped - valid.double()  # 0 off the mask
    abs_diff = log_ratio.abs()
    if dropped is None:
        dropped = rollout_correction(old_logprobs, rollout_logprobs, mask, cfg).dropped
    parts = [abs_diff.sum(), k3.sum(), ratio.sum(), dropped.sum().double(), valid.sum().double()]
    sums = torch.stack(parts)
    biggest = torch.cat([abs_diff.flatten(), abs_diff.new_zeros(1)]).amax().reshape(1)
    if group is not None:
        if device is not None:
            sums, biggest = sums.to(device), biggest.to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(biggest, op=dist.ReduceOp.MAX, group=group)
    abs_sum, k3_sum, ratio_sum, dropped_sum, count = sums.cpu().tolist()
    n = max(count, 1.0)
    return {
        "mismatch/logprob_abs_diff_mean": abs_sum / n,
        "mismatch/logprob_abs_diff_max": float(biggest.item()),
        "mismatch/kl": k3_sum / n,
        "mismatch/ratio_mean": ratio_sum / n,
        "mismatch/masked_share": dropped_sum / n,
    }
