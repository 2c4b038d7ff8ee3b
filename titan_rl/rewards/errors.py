"""Errors a reward raises that the run cannot score around."""

from __future__ import annotations


class RewardError(RuntimeError):
    """A reward call failed (the function raised, or its worker process died)."""


class InvalidRewardError(RewardError, ValueError):
    """A reward returned something other than a bool or a number finite in float32 (NaN,
    inf, 1e39, None, a string, a dict without a score), or a ``correct`` that is not a bool
    (``"False"``)."""


class RewardTimeoutsError(RewardError):
    """More of a step's reward calls timed out than ``reward.max_timeout_share``, under
    ``reward.on_timeouts=stop``."""
