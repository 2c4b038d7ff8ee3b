"""Errors a reward raises that the run cannot score around."""

from __future__ import annotations


class RewardError(RuntimeError):
    """A reward call failed (the function raised, or its worker process died)."""


class InvalidRewardError(RewardError, ValueError):
    """A reward returned something other than a finite number or a bool (NaN, inf, None,
    a string, a dict without a score)."""
