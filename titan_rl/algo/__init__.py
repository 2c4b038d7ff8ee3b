"""RL algorithms: advantage estimators and the policy loss (slime/verl conventions)."""

from titan_rl.algo.advantages import compute_advantages, masked_whiten
from titan_rl.algo.config import AlgoConfig
from titan_rl.algo.losses import aggregate, kl_penalty, policy_loss

__all__ = [
    "AlgoConfig",
    "aggregate",
    "compute_advantages",
    "kl_penalty",
    "masked_whiten",
    "policy_loss",
]
