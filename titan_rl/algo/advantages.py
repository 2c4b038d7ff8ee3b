"""Advantages of a whole rollout batch under ``algo.advantage_estimator``: the batch and the
``algo`` section prepared once, then the estimator's function from the table
(:mod:`titan_rl.algo.estimators`, where each estimator and its math live).

Rows are grouped consecutively: ``rewards[g * group_size:(g + 1) * group_size]`` are the
samples of prompt ``g``. Every estimator returns a ``[B, T]`` tensor that is zero outside the
response mask, so it can be sliced into microbatches and data-parallel shards as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.estimators import (
    ESTIMATORS,
    STD_EPS,
    WHITEN_EPS,
    AdvantageInputs,
    discounted_returns,
    masked_whiten,
)

__all__ = ["STD_EPS", "WHITEN_EPS", "compute_advantages", "discounted_returns", "masked_whiten"]


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
    mask = response_mask.to(torch.float32)
    token_kl = None
    if cfg.use_kl_in_reward:
        if kl is None:
            raise ValueError("algo.use_kl_in_reward is true but no kl tensor was given")
        token_kl = cfg.kl_in_reward_coef * kl.to(torch.float32) * mask
    inputs = AdvantageInputs(rewards.to(torch.float32), group_size, mask, token_kl, cfg, group)
    return ESTIMATORS[cfg.advantage_estimator].fn(inputs)
