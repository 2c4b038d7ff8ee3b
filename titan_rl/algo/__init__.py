"""RL algorithms: advantage estimators, the policy loss and the train / rollout mismatch
corrections (slime/verl conventions)."""

from titan_rl.algo.advantages import compute_advantages, masked_whiten
from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.losses import aggregate, kl_penalty, policy_loss
from titan_rl.algo.rollout_correction import mismatch_metrics, rollout_correction

__all__ = [
    "AlgoConfig",
    "aggregate",
    "compute_advantages",
    "kl_penalty",
    "masked_whiten",
    "mismatch_metrics",
    "policy_loss",
    "rollout_correction",
]
