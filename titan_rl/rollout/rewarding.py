"""Rewards of rollout samples, scored off the driver's event loop (titan_rl.rewards.pool).

The built-in exact match without a ``format_pattern`` is the one reward scored inline: a
comparison of a bounded string that can neither block nor return a non-finite value, where a
worker round trip would cost ~100x more (0.1-0.4 ms against ~3 us per sample, measured on 2
cores). Everything that runs user code or sympy (custom, math_verify, a format regex) goes
through the worker pool under ``reward.timeout_s``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from titan_rl.rewards.config import RewardConfig
from titan_rl.rewards.pool import RewardPool, timeouts_note
from titan_rl.rewards.scorer import RewardResult, RewardScorer
from titan_rl.sample import Sample, Status


@dataclass
class RewardCounts:
    """Samples whose reward call timed out, and those dropped for an invalid reward (of
    ``scored``: the samples scored)."""

    timeouts: int = 0
    invalid: int = 0
    scored: int = 0

    def add(self, other: RewardCounts) -> None:
        self.timeouts += other.timeouts
        self.invalid += other.invalid
        self.scored += other.scored


class SampleRewarder:
    """Scores samples in place: ``reward`` and ``correct``; a sample whose reward was invalid
    under ``reward.on_invalid=drop`` gets status FAILED (left out of the loss) and reward 0."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        inline = cfg.type == "exact_match" and cfg.format_pattern is None
        self._inline = RewardScorer(cfg) if inline else None
        self._pool = None if inline else RewardPool(cfg)
        #: what was scored since the last :meth:`check_timeouts`
        self.tally = RewardCounts()

    async def _results(self, samples: list[Sample]) -> list[RewardResult]:
        if self._inline is not None:
            return [self._inline.score_one(s.prompt, s.response, s.label) for s in samples]
        assert self._pool is not None
        return await self._pool.score(
            [s.prompt for s in samples],
            [s.response for s in samples],
            [s.label for s in samples],
            [s.metadata for s in samples],
        )

    async def __call__(self, samples: list[Sample]) -> RewardCounts:
        counts = RewardCounts(scored=len(samples))
        for s, r in zip(samples, await self._results(samples), strict=True):
            s.reward = r.score
            s.correct = r.is_correct
            if r.status == "timeout":
                counts.timeouts += 1
            elif r.status == "invalid":
                counts.invalid += 1
                s.status = Status.FAILED
        self.tally.add(counts)
        return counts

    def check_timeouts(self, what: str) -> str | None:
        """Close ``what`` (``"step 3"``, ``"evaluation"``): when more than
        ``reward.max_timeout_share`` of the samples scored since the last check timed out,
        print a warning line naming the count (and return it), or under
        ``reward.on_timeouts=stop`` raise RewardTimeoutsError naming the key."""
        tally, self.tally = self.tally, RewardCounts()
        note = timeouts_note(self.cfg, tally.timeouts, tally.scored, what)
        if note is not None:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        return note

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
