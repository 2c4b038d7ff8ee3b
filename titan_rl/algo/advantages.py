"""Advantage estimators (slime/verl conventions), computed over a whole rollout batch.

Rows are grouped consecutively: ``rewards[g * group_size:(g + 1) * group_size]`` are the
samples of prompt ``g``. Every estimator returns a ``[B, T]`` tensor that is zero outside the
response mask, so it can be sliced into microbatches and data-parallel shards as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titan_rl.algo.config import AlgoConfig

#: added to the group std (grpo); verl and slime use 1e-6.
STD_EPS = 1e-6
#: added to the variance when whitening (reinforce++); verl uses 1e-8.
WHITEN_EPS = 1e-8


def _grouped(x: Tensor, group_size: int) -> Tensor:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if x.numel() % group_size:
        raise ValueError(
            f"batch of {x.numel()} rewards is not a multiple of group_size {group_size}"
        )
    return x.view(-1, group_size)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = WHITEN_EPS, group: Any = None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over the valid tokens (unbiased var); zero where masked.

    ``group``: a torch.distributed process group (the data-parallel one) whose ranks hold
    the other rows of the batch: the mean and variance are then the whole batch's, as
    slime and verl whiten, so the result does not depend on how rows are split over ranks.
    """
    m = mask.to(x.dtype)
    sums = torch.stack([m.sum(), (x * m).sum(), (x * x * m).sum()]).double()
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(sums, group=group)
    n, total, squares = sums.unbind()
    if n < 2:
        raise ValueError("whitening needs at least 2 valid response tokens in the batch")
    mean = total / n
    var = ((squares - n * mean * mean) / (n - 1)).clamp(min=0.0)
    return ((x - mean.to(x.dtype)) * torch.rsqrt(var + eps).to(x.dtype)) * m


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} at every position, kept on the valid tokens.

    The return runs through masked positions inside a response (a tool's reply in a
    multi-turn rollout carries no reward and no loss, but the outcome reward still reaches
    the tokens before it), as slime's ``chunked_discounted_returns`` and verl since its
    PR #7300 compute it; masked positions only contribute their own (zero) reward.
    """
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running
        returns[:, t] = running
    return returns * mask.to(token_rewards.dtype)


def _last_token_index(mask: Tensor) -> Tensor:
    """Index of the last valid token of each row (0 for rows without any)."""
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), t, torch.zeros_like(t)).max(dim=1).values


def compute_advantages(
    rewards: Tensor,
    group_size: int,
    response_mask: Tensor,
    cfg: AlgoConfig,
    kl: Tensor | None = None,
    group: Any = None,
) -> Tensor:
    """Advantages ``[B, T]`` for ``rewards [B]`` under ``cfg.advantage_estimator``.

    ``kl [B, T]`` is the per-token KL between the sampling policy and the reference (e.g.
    ``kl_penalty(old_logprobs, ref_logprobs, "k1")``); it is required when
    ``cfg.use_kl_in_reward``. Sequence-level estimators then use the shaped reward
    ``r - kl_in_reward_coef * sum_t kl_t``; reinforce++ puts ``-coef * kl_t`` on every token.
    ``group``: the data-parallel process group when these are one rank's rows of the batch;
    reinforce++ (baseline) whitening then uses the whole batch's statistics (the group
    estimators need whole prompt groups on each rank, which the DP split keeps).
    """
    if rewards.dim() != 1 or response_mask.dim() != 2 or response_mask.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"expected rewards [B] and response_mask [B, T], got {tuple(rewards.shape)} "
            f"and {tuple(response_mask.shape)}"
        )
    est = cfg.advantage_estimator
    mask = response_mask.to(torch.float32)
    r = rewards.to(torch.float32)
    token_kl = None
    if cfg.use_kl_in_reward:
        if kl is None:
            raise ValueError("algo.use_kl_in_reward is true but no kl tensor was given")
        token_kl = cfg.kl_in_reward_coef * kl.to(torch.float32) * mask

    if est == "reinforce_plus_plus":
        token_rewards = -token_kl if token_kl is not None else torch.zeros_like(mask)
        last = _last_token_index(mask)
        has_tokens = mask.sum(dim=1) > 0
        rows = torch.arange(r.shape[0], device=r.device)
        token_rewards[rows, last] += torch.where(has_tokens, r, torch.zeros_like(r))
        return masked_whiten(discounted_returns(token_rewards, mask, cfg.gamma), mask, group=group)

    if est == "reinforce_plus_plus_baseline":
        g = _grouped(r, group_size)
        centred = (g - g.mean(dim=1, keepdim=True)).reshape(-1)
        adv = centred[:, None] * mask
        if token_kl is not None:
            adv = adv - token_kl
        return masked_whiten(adv, mask, group=group)

    if token_kl is not None:
        r = r - token_kl.sum(dim=1)
    g = _grouped(r, group_size)
    mean = g.mean(dim=1, keepdim=True)
    if est in ("grpo", "gspo"):
        adv = g - mean
        if cfg.normalize_advantage_std:
            # A single-sample group has no std: leave it unscaled (verl uses std = 1 there).
            std = g.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(mean)
            adv = adv / (std + STD_EPS)
    elif est == "dr_grpo":
        adv = g - mean
    elif est == "rloo":
        if group_size < 2:
            raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline)")
        others = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
        adv = g - others
    else:  # pragma: no cover - the config's Literal rules this out
        raise ValueError(f"unknown advantage estimator {est!r}")
    return adv.reshape(-1)[:, None] * mask
