"""The advantage estimators: each one's function and properties, in the one table
(:data:`ESTIMATORS`) that ``algo.advantage_estimator``'s choices, the config's checks, the
loss, the preflight's warnings and the adapters' flag table read.

A new estimator is a function here and its entry in the table (slime/verl conventions: rows
are grouped consecutively, ``rewards[g * group_size:(g + 1) * group_size]`` being the samples
of prompt ``g``; the result is a ``[B, T]`` tensor that is zero outside the response mask, so
it can be sliced into microbatches and data-parallel shards as is).

An estimator whose baseline is its prompt's group (``group_baseline``) compares the samples
of one prompt: with ``rollout.n_samples_per_prompt=1`` every reward equals its baseline and
the reward never reaches an advantage (all zero, or only the KL penalty), and with
``rollout.temperature=0`` every sample of a group is the same greedy answer (the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

#: added to the group std (grpo); verl and slime use 1e-6.
STD_EPS = 1e-6
#: added to the variance when whitening (reinforce++); verl uses 1e-8.
WHITEN_EPS = 1e-8


@dataclass(frozen=True)
class AdvantageInputs:
    """What an estimator computes from, as :func:`~titan_rl.algo.advantages.compute_advantages`
    prepares it from the batch and the ``algo`` section."""

    #: ``[B]`` float32 rewards, one per sample
    rewards: Tensor
    #: samples per prompt (consecutive rows)
    group_size: int
    #: ``[B, T]`` float32 response mask
    mask: Tensor
    #: ``[B, T]``: ``kl_in_reward_coef * KL`` on the valid tokens (``algo.use_kl_in_reward``),
    #: else None
    token_kl: Tensor | None
    #: the ``algo`` section (an AlgoConfig; not imported: its choices are this table's)
    algo: Any
    #: the data-parallel process group when these are one rank's rows of the batch
    group: Any = None

    def sequence_rewards(self) -> Tensor:
        """The rewards with the KL penalty of each sequence taken off (sequence-level
        estimators): ``r - sum_t token_kl``."""
        if self.token_kl is None:
            return self.rewards
        return self.rewards - self.token_kl.sum(dim=1)

    def on_tokens(self, per_sequence: Tensor) -> Tensor:
        """A ``[B]`` (or grouped ``[G, n]``) advantage on every valid token of its row."""
        return per_sequence.reshape(-1)[:, None] * self.mask


Estimate = Callable[[AdvantageInputs], Tensor]


@dataclass(frozen=True)
class Estimator:
    """An advantage estimator and the properties the code outside it branches on."""

    #: ``(AdvantageInputs) -> [B, T]`` advantages
    fn: Estimate
    #: the baseline is the mean (or leave-one-out mean) of the prompt's group: it needs
    #: ``rollout.n_samples_per_prompt >= 2`` and a temperature above 0
    group_baseline: bool
    #: what it computes, in a few words (for error messages and docs)
    summary: str
    #: without a KL in the reward, a sequence's advantage is a function of its group's
    #: rewards alone (no whitening over the batch's tokens, no per-token returns), the same
    #: on each of its tokens: what the slime / miles adapters' rollout side computes per
    #: sample, so what they train
    from_group_rewards: bool = True
    #: the policy loss takes one importance ratio per sequence (the mean of its tokens'
    #: log-ratios, GSPO) instead of one per token
    sequence_ratio: bool = False


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


def grpo(x: AdvantageInputs) -> Tensor:
    """Group-centred reward, divided by the group std unless algo.normalize_advantage_std
    is false (grpo, gspo)."""
    g = _grouped(x.sequence_rewards(), x.group_size)
    mean = g.mean(dim=1, keepdim=True)
    adv = g - mean
    if x.algo.normalize_advantage_std:
        # A single-sample group has no std: leave it unscaled (verl uses std = 1 there).
        std = g.std(dim=1, keepdim=True) if x.group_size > 1 else torch.ones_like(mean)
        adv = adv / (std + STD_EPS)
    return x.on_tokens(adv)


def dr_grpo(x: AdvantageInputs) -> Tensor:
    """Group-centred reward, never divided by the std (Dr. GRPO)."""
    g = _grouped(x.sequence_rewards(), x.group_size)
    return x.on_tokens(g - g.mean(dim=1, keepdim=True))


def rloo(x: AdvantageInputs) -> Tensor:
    """Reward minus the mean of the group's other samples (leave-one-out)."""
    g = _grouped(x.sequence_rewards(), x.group_size)
    if x.group_size < 2:
        raise ValueError("rloo needs group_size >= 2 (a leave-one-out baseline)")
    others = (g.sum(dim=1, keepdim=True) - g) / (x.group_size - 1)
    return x.on_tokens(g - others)


def reinforce_plus_plus(x: AdvantageInputs) -> Tensor:
    """Discounted token returns (the reward on the last token, ``-kl`` on every token),
    whitened over the batch."""
    mask, r = x.mask, x.rewards
    token_rewards = -x.token_kl if x.token_kl is not None else torch.zeros_like(mask)
    last = _last_token_index(mask)
    has_tokens = mask.sum(dim=1) > 0
    rows = torch.arange(r.shape[0], device=r.device)
    token_rewards[rows, last] += torch.where(has_tokens, r, torch.zeros_like(r))
    returns = discounted_returns(token_rewards, mask, x.algo.gamma)
    return masked_whiten(returns, mask, group=x.group)


def reinforce_plus_plus_baseline(x: AdvantageInputs) -> Tensor:
    """Group-centred reward on every token (minus the token's KL), whitened over the batch."""
    g = _grouped(x.rewards, x.group_size)
    adv = x.on_tokens(g - g.mean(dim=1, keepdim=True))
    if x.token_kl is not None:
        adv = adv - x.token_kl
    return masked_whiten(adv, x.mask, group=x.group)


#: every estimator algo.advantage_estimator accepts, in the order the config lists them
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator(grpo, True, "group-centred reward, divided by the group std"),
    "dr_grpo": Estimator(dr_grpo, True, "group-centred reward (Dr. GRPO: no std)"),
    "gspo": Estimator(
        grpo, True, "grpo advantages, a sequence-level ratio in the loss", sequence_ratio=True
    ),
    "rloo": Estimator(rloo, True, "reward minus the mean of the group's other samples"),
    "reinforce_plus_plus": Estimator(
        reinforce_plus_plus,
        False,
        "discounted token returns, whitened over the batch",
        from_group_rewards=False,
    ),
    "reinforce_plus_plus_baseline": Estimator(
        reinforce_plus_plus_baseline,
        True,
        "group-centred reward, whitened over the batch",
        from_group_rewards=False,
    ),
}

#: algo.advantage_estimator's type: the table's names
AdvantageEstimator = Literal[tuple(ESTIMATORS)]  # type: ignore[valid-type]

#: the estimators that compare the samples of one prompt (need n_samples_per_prompt >= 2)
GROUP_ESTIMATORS: tuple[str, ...] = tuple(n for n, e in ESTIMATORS.items() if e.group_baseline)


def group_size_problem(estimator: str, n_samples_per_prompt: int) -> str | None:
    """Why ``estimator`` cannot learn with ``n_samples_per_prompt`` samples per prompt
    (naming both keys), or None."""
    if ESTIMATORS[estimator].group_baseline and n_samples_per_prompt < 2:
        return (
            f"algo.advantage_estimator={estimator} compares the samples of a prompt (its "
            f"baseline is the group's): with rollout.n_samples_per_prompt="
            f"{n_samples_per_prompt} every reward equals its baseline and none reaches an "
            "advantage; set rollout.n_samples_per_prompt >= 2, or "
            "algo.advantage_estimator=reinforce_plus_plus (a batch baseline)"
        )
    return None
