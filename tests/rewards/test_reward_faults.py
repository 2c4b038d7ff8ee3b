"""Reward faults: a value that is not a number finite in float32, or a ``correct`` that is not
a bool, is refused where it enters (or the sample dropped and counted); a reward that blocks,
raises or kills its process costs one worker for reward.timeout_s at most (replacing it does
not run the driver's main module again) and never blocks the event loop or later calls; a
step where most calls time out is warned, or stopped under reward.on_timeouts=stop."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from titan_core.config import ConfigError
from titan_rl.rewards import RewardConfig, RewardScorer
from titan_rl.rewards.errors import InvalidRewardError, RewardError, RewardTimeoutsError
from titan_rl.rewards.math_answer import SubprocessRunner
from titan_rl.rewards.pool import RewardPool, preloaded_modules, timeouts_note
from titan_rl.rewards.scorer import checked_correct, checked_score
from titan_rl.rollout.generate import _fill_dropped
from titan_rl.rollout.rewarding import SampleRewarder
from titan_rl.sample import Sample, Status
from titan_rl.trainer.batch import pack_samples

FN = "tests.rewards.fault_fns:by_response"
ASYNC_FN = "tests.rewards.fault_fns:async_by_response"
REPO = Path(__file__).resolve().parents[2]
#: 1e39 and 10**39 are finite in Python and inf in float32, the trainer's dtype
INVALID = [math.nan, math.inf, -math.inf, None, "1", "nan", [1.0], 10**400, object(),
           1e39, -1e39, 10**39, np.float64(3.5e38)]  # fmt: skip


def _cfg(path: str = FN, **kw: Any) -> RewardConfig:
    return RewardConfig(type="custom", custom_path=path, **kw)


# ---------------------------------------------------------------- where values enter


@pytest.mark.parametrize(
    ("value", "score"),
    [(1, 1.0), (-0.25, -0.25), (True, 1.0), (False, 0.0), (np.float32(0.5), 0.5),
     (np.int64(3), 3.0), (np.bool_(True), 1.0), (Fraction(1, 4), 0.25), (-3e38, -3e38),
     (float(np.finfo(np.float32).max), float(np.finfo(np.float32).max))],
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


@pytest.mark.parametrize(
    ("value", "correct"),
    [(True, True), (False, False), (np.bool_(False), False), (np.bool_(True), True),
     (0, False), (1, True), (1.0, True), (np.int64(0), False), (None, None)],
)  # fmt: skip
@pytest.mark.parametrize("field", ["correct", "acc"])
def test_correct_is_a_bool_or_0_or_1(value: Any, correct: bool | None, field: str):
    assert checked_correct(value, "reward.custom_path x:f", "s", field) is correct
    out = {"score": 0.5, field: value}
    got = RewardScorer(_cfg()).score_one("p", "value", "l", {"value": out})
    assert (got.score, got.correct) == (0.5, correct)
    assert got.is_correct is (correct if correct is not None else False)


@pytest.mark.parametrize("value", ["False", "True", "", 0.5, 2, -1, math.nan, [True]], ids=repr)
@pytest.mark.parametrize("field", ["correct", "acc"])
def test_a_correct_that_is_not_a_bool_is_an_error_naming_the_field(value: Any, field: str):
    # bool("False") is True: taken as is, a wrong answer counted as right (accuracy 1.0 at
    # reward 0.5)
    with pytest.raises(InvalidRewardError) as e:
        RewardScorer(_cfg()).score_one(
            "what is 7*6?", "value", "42", {"value": {"score": 0.5, field: value}}
        )
    msg = str(e.value)
    assert f"reward.custom_path {FN} returned '{field}': {value!r}" in msg, msg
    assert "'what is 7*6?'" in msg and "label '42'" in msg and "reward.on_invalid=drop" in msg


def test_a_format_reward_that_overflows_float32_is_an_error():
    cfg = _cfg(format_pattern="value", format_reward=3e38)
    with pytest.raises(InvalidRewardError, match=r"returned 3e\+38 .* not finite in float32"):
        RewardScorer(cfg).score_one("p", "value", "l", {"value": 3e38})
    assert RewardScorer(cfg).score_one("p", "value", "l", {"value": -3e38}).score == 0.0


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
     ({"num_workers": 0}, "num_workers"), ({"timeout_score": 1e39}, "timeout_score"),
     ({"format_reward": -1e39}, "format_reward"), ({"on_timeouts": "skip"}, "on_timeouts"),
     ({"max_timeout_share": 1.5}, "max_timeout_share")],
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
def test_a_string_correct_and_a_float32_overflow_are_dropped_not_counted_right():
    rewarder = SampleRewarder(_cfg(num_workers=2, on_invalid="drop"))
    metas = [{"value": {"score": 0.5, "correct": "False"}}, {"value": 1e39},
             {"value": {"score": 1.0, "correct": True}}, {"value": {"score": 0.5, "acc": 1}}]  # fmt: skip
    group = _group(["value"] * 4, metas)
    try:
        counts = asyncio.run(rewarder(group))
    finally:
        rewarder.close()
    assert (counts.invalid, counts.scored) == (2, 4)
    assert [s.status == Status.FAILED for s in group] == [True, True, False, False]
    # rollout/accuracy and eval/accuracy read these: the dropped ones are wrong
    assert [s.correct for s in group] == [False, False, True, True]
    _fill_dropped(group)
    assert all(np.isfinite(np.float32(s.reward)) for s in group)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["module", "path"])
def test_replacing_a_worker_does_not_run_the_drivers_main_again(tmp_path, how):
    """A driver whose main module is heavy to import (python -m titan_rl.grpo: ~2 s of torch
    and configs): multiprocessing's forkserver children would run it again, each replaced
    worker paying its import (the job crawled when every reward timed out)."""
    log = tmp_path / "imports.log"
    main = ["-m", "tests.rewards.counting_main"] if how == "module" else [
        str(REPO / "tests/rewards/counting_main.py")]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, *main, "--hangs", "3", "--timeout-s", "0.3"],
        capture_output=True, text=True, cwd=REPO, timeout=100,
        env=dict(os.environ, COUNTING_MAIN_LOG=str(log)),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["statuses"] == ["timeout"] * 3 + ["scored"]
    # the driver imported it once; none of the 4 workers (1 + 3 replacements) did
    assert [line.split()[0] for line in log.read_text().splitlines()] == ["__main__"]
    assert out["per_replacement_s"] < 1.0, out  # 2 s and more when workers re-import main


def test_the_forkserver_preloads_titan_and_math_verify_never_user_code():
    assert preloaded_modules(_cfg()) == ["titan_rl.rewards.pool"]
    assert preloaded_modules(RewardConfig(type="math_verify"))[1:] == ["math_verify"]


@pytest.mark.parametrize(
    ("timeouts", "scored", "share", "acts"),
    [(0, 0, 0.5, False), (64, 128, 0.5, False), (65, 128, 0.5, True), (128, 128, 0.5, True),
     (1, 128, 0.0, True), (0, 128, 0.0, False), (128, 128, 1.0, False)],
)  # fmt: skip
def test_most_calls_timing_out_is_warned_or_stops(timeouts, scored, share, acts):
    warn = _cfg(timeout_s=2, max_timeout_share=share)
    note = timeouts_note(warn, timeouts, scored, "step 3")
    assert (note is not None) is acts
    stop = _cfg(timeout_s=2, max_timeout_share=share, on_timeouts="stop")
    if not acts:
        assert timeouts_note(stop, timeouts, scored, "step 3") is None
        return
    assert note.startswith(f"step 3: {timeouts} of {scored} reward calls (reward.custom_path")
    assert "reward.timeout_s=2" in note and "reward.on_timeouts=stop" in note
    with pytest.raises(RewardTimeoutsError, match=r"step 3: .* \(reward\.on_timeouts=stop\)"):
        timeouts_note(stop, timeouts, scored, "step 3")


@pytest.mark.timeout(120)
def test_the_rewarder_checks_the_timeouts_of_what_it_scored_since_the_last_check(capsys):
    rewarder = SampleRewarder(_cfg(num_workers=2, timeout_s=0.3, on_timeouts="stop"))
    try:
        asyncio.run(rewarder(_group(["hang", "hang", "ok"], [{}] * 3)))
        assert rewarder.tally.timeouts == 2 and rewarder.tally.scored == 3
        with pytest.raises(RewardTimeoutsError, match=r"^step 1: 2 of 3 reward calls"):
            rewarder.check_timeouts("step 1")
        asyncio.run(rewarder(_group(["hang", "ok", "ok"], [{}] * 3)))
        assert rewarder.check_timeouts("step 2") is None  # 1 of 3: the tally restarted
        rewarder.cfg = _cfg(timeout_s=0.3, max_timeout_share=0.2)  # on_timeouts=warn
        asyncio.run(rewarder(_group(["hang", "ok", "ok"], [{}] * 3)))
        note = rewarder.check_timeouts("evaluation")
        assert note and f"warning: {note}" in capsys.readouterr().err
    finally:
        rewarder.close()


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
