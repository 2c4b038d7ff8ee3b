"""Rewards: exact match (arithmetic default), math-verify, custom ``module:function``, format;
scored off the event loop in worker processes (``RewardPool``)."""

from titan_rl.rewards.config import RewardConfig
from titan_rl.rewards.custom import load_custom_reward
from titan_rl.rewards.errors import InvalidRewardError, RewardError
from titan_rl.rewards.math_answer import extract_boxed, extract_math_answer, verify_answer
from titan_rl.rewards.pool import RewardPool
from titan_rl.rewards.scorer import RewardResult, RewardScorer, exact_match, first_line_answer

__all__ = [
    "InvalidRewardError",
    "RewardConfig",
    "RewardError",
    "RewardPool",
    "RewardResult",
    "RewardScorer",
    "exact_match",
    "extract_boxed",
    "extract_math_answer",
    "first_line_answer",
    "load_custom_reward",
    "verify_answer",
]
