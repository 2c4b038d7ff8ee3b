"""Reward faults: a value that is not a finite number is refused where it enters (or the
sample dropped and counted); a reward that blocks, raises or kills its process costs one
worker for reward.timeout_s at most and never blocks the event loop or later calls."""

from __future__ import annotations

import asyncio
import math
import os
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from titan_core.config import ConfigError
from titan_rl.rewards import RewardConfig, RewardScorer
from titan_rl.rewards.errors import InvalidRewardError, RewardError
from titan_rl.rewards.math_answer import SubprocessRunner
from titan_rl.rewards.pool import RewardPool
from titan_rl.rewards.scorer import checked_score
from titan_rl.rollout.generate import _fill_dropped
from titan_rl.rollout.rewarding import SampleRewarder
from titan_rl.sample import Sample, Status
from titan_rl.trainer.batch import pack_samples

FN = "tests.rewards.fault_fns:by_response"
ASYNC_FN = "tests.rewards.fault_fns:async_by_response"
INVALID = [math.nan, math.inf, -math.inf, None, "1", "nan", [1.0], 10**400, object()]


def _cfg(path: str = FN, **kw: Any) -> RewardConfig:
    return RewardConfig(type="custom", custom_path=path, **kw)


# ---------------------------------------------------------------- where values enter


@pytest.mark.parametrize(
    ("value", "score"),
    [(1, 1.0), (-0.25, -0.25), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5),
     (np.int64(3), 3.0), (np.bool_(True), 1.0), (Fraction(1, 4), 0.25)],
)  # fmt: skip
def test_finite_numbers_and_bools_are_scores(value: Any, score: float):
    assert checked_score(value, "reward.custom_path x:f", "s") == score
    got = RewardScorer(_cfg()).score_one("p", "value", "l", {"value": value})
    assert got.score == score and isinstance(got.score, float)


@pytest.mark.parametrize("value", INVALID, ids=repr)
@pytest.mark.parametrize("as_dict", [False, True])
def test_anything_else_is_an_error_naming_the_key_value_and_sample(value: Any, as_dict: bool):
    scorer = RewardScorer(_cfg())
    out = {"score": value, "correct": True} if as_dict else value
    with pytest.raises(InvalidRewardError) as e:
        scorer.score_one("what is 7*6?", "value", "42", {"value": out})
    msg = str(e.value)
    assert f"reward.custom_path {FN}" in msg and "reward.on_invalid=drop" in msg
    assert "'what is 7*6?'" in msg and "'value'" in msg and "label '42'" in msg
    assert repr(value)[:20] in msg


def test_a_long_sample_is_shortened_in_the_message():
    with pytest.raises(InvalidRewardError) as e:
        RewardScorer(_cfg()).score_one("q" * 1000, "value", "l", {"value": math.nan})
    assert "q" * 80 + "..." in str(e.value) and "q" * 81 not in str(e.value)


def test_an_async_custom_reward_is_awaited():
    scorer = RewardScorer(_cfg(ASYNC_FN))
    try:
        assert scorer.score_one("p", "r", "l").score == 0.5
        with pytest.raises(InvalidRewardError, match="nan"):
            scorer.score_one("p", "value", "l", {"value": math.nan})
    finally:
        scorer.close()


@pytest.mark.parametrize(
    ("override", "key"),
    [({"on_invalid": "skip"}, "on_invalid"), ({"format_reward": math.nan}, "format_reward"),
     ({"timeout_score": math.inf}, "timeout_score"), ({"timeout_s": math.inf}, "timeout_s"),
     ({"num_workers": 0}, "num_workers")],
)  # fmt: skip
def test_bad_fault_settings_are_refused(override: dict, key: str):
    from pydantic import BaseModel, Field

    from titan_core.config import load_config

    class Root(BaseModel):
        reward: RewardConfig = Field(default_factory=RewardConfig)

    ((k, v),) = override.items()
    with pytest.raises(ConfigError, match=rf"reward\.{key}"):
        load_config(Root, None, [f"reward.{k}={v}"])


# ---------------------------------------------------------------- the worker pool


def _score(pool: RewardPool, responses: list[str], metas: list[dict] | None = None) -> list:
    async def main() -> list:
        n = len(responses)
        return await pool.score(["p"] * n, responses, ["l"] * n, metas or [{}] * n)

    return asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_hanging_reward_times_out_and_its_worker_is_replaced():
    pool = RewardPool(_cfg(timeout_s=0.5, timeout_score=-1.0, num_workers=1))
    try:
        # one worker: the calls after the stuck one run only once it has been replaced
        got = _score(pool, ["hang", "ok", "hang", "ok"])
        assert [r.status for r in got] == ["timeout", "scored", "timeout", "scored"]
        assert [r.score for r in got] == [-1.0, 1.0, -1.0, 1.0]
        assert [r.is_correct for r in got] == [False, True, False, True]
    finally:
        pool.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("response", ["block", "wait"])
def test_an_async_reward_that_blocks_its_loop_times_out_too(response: str):
    pool = RewardPool(_cfg(ASYNC_FN, timeout_s=0.5, num_workers=1))
    try:
        got = _score(pool, [response, "ok"])
        assert [(r.status, r.score) for r in got] == [("timeout", 0.0), ("scored", 0.5)]
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_the_event_loop_runs_while_a_reward_hangs():
    pool = RewardPool(_cfg(timeout_s=1.0, num_workers=1))

    async def main() -> tuple[int, list]:
        ticks = 0
        scoring = asyncio.ensure_future(pool.score(["p"], ["hang"], ["l"], [{}]))
        while not scoring.done():
            await asyncio.sleep(0.01)
            ticks += 1
        return ticks, scoring.result()

    try:
        ticks, got = asyncio.run(main())
        assert got[0].status == "timeout"
        assert ticks >= 5, "the reward blocked the event loop"
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_invalid_values_error_or_drop():
    metas = [{}, {"value": math.nan}, {"value": "1"}]
    pool = RewardPool(_cfg(num_workers=2))
    try:
        with pytest.raises(InvalidRewardError, match=r"reward\.custom_path .*returned nan"):
            _score(pool, ["ok", "value", "ok"], metas)
    finally:
        pool.close()
    pool = RewardPool(_cfg(num_workers=2, on_invalid="drop"))
    try:
        got = _score(pool, ["ok", "value", "value"], metas)
        assert [r.status for r in got] == ["scored", "invalid", "invalid"]
        assert got[0].score == 1.0 and not got[1].is_correct
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_reward_that_raises_or_kills_its_worker_is_an_error_and_the_pool_lives_on():
    pool = RewardPool(_cfg(num_workers=1))
    try:
        with pytest.raises(RewardError, match=r"reward\.custom_path .* raised KeyError"):
            _score(pool, ["raise"])
        with pytest.raises(RewardError, match=r"worker died \(exit code 7\)"):
            _score(pool, ["die"])
        assert [r.score for r in _score(pool, ["ok", "ok"])] == [1.0, 1.0]
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_math_verify_runs_in_the_pool():
    pool = RewardPool(RewardConfig(type="math_verify", num_workers=1))
    try:

        async def main() -> list:
            return await pool.score(
                ["q", "q"], [r"\boxed{\frac{1}{2}}", "7"], ["0.5"] * 2, [{}] * 2
            )

        assert [r.is_correct for r in asyncio.run(main())] == [True, False]
    finally:
        pool.close()


# ---------------------------------------------------------------- samples and the loss


def _group(responses: list[str], metas: list[dict]) -> list[Sample]:
    return [
        Sample(group_index=0, index=i, prompt="p", prompt_tokens=[1, 2], label="l",
               response=r, response_tokens=[3, 4], metadata=m)
        for i, (r, m) in enumerate(zip(responses, metas, strict=True))
    ]  # fmt: skip


@pytest.mark.timeout(120)
def test_a_dropped_sample_is_counted_takes_the_group_mean_and_has_no_loss():
    rewarder = SampleRewarder(_cfg(num_workers=2, on_invalid="drop", timeout_s=0.5))
    metas = [{"value": 0.0}, {"value": math.inf}, {}, {}, {"value": 0.5}]
    group = _group(["value", "value", "ok", "hang", "value"], metas)
    try:
        counts = asyncio.run(rewarder(group))
    finally:
        rewarder.close()
    assert (counts.timeouts, counts.invalid) == (1, 1)
    assert [s.status for s in group].count(Status.FAILED) == 1 and group[1].status == Status.FAILED
    _fill_dropped(group)
    scored = [0.0, 1.0, 0.0, 0.5]  # the timed-out sample scores timeout_score (0)
    assert group[1].reward == pytest.approx(sum(scored) / len(scored))
    assert all(math.isfinite(s.reward) for s in group)
    mask = pack_samples(group, pad_id=0).response_mask
    assert mask[1].sum() == 0 and torch.all(mask[[0, 2, 3, 4]].sum(1) == 2)


def test_exact_match_without_a_pattern_is_scored_inline():
    rewarder = SampleRewarder(RewardConfig())
    group = _group(["l", "x"], [{}, {}])
    assert asyncio.run(rewarder(group)).timeouts == 0
    assert [s.reward for s in group] == [1.0, 0.0] and rewarder._pool is None
    rewarder.close()


# ---------------------------------------------------------------- math-verify's helper


def test_subprocess_runner_recovers_after_its_helper_dies():
    runner = SubprocessRunner()
    try:
        assert runner.run(os._exit, (3,), 60.0, "dead") == "dead"
        assert runner.run(abs, (-3,), 60.0, None) == 3  # a fresh helper
    finally:
        runner.close()
