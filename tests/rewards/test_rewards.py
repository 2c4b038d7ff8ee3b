"""Rewards: exact match, math-verify (incl. tricky equivalences), format, custom functions."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from pydantic import BaseModel, Field

from titan_core.config import ConfigError, load_config
from titan_rl.preflight import check_reward
from titan_rl.rewards import (
    RewardConfig,
    RewardScorer,
    exact_match,
    extract_boxed,
    extract_math_answer,
    first_line_answer,
    verify_answer,
)
from titan_rl.rewards.math_answer import SubprocessRunner


class _Root(BaseModel):
    reward: RewardConfig = Field(default_factory=RewardConfig)


def _load(*overrides: str) -> RewardConfig:
    return load_config(_Root, None, list(overrides)).reward


# ---------------------------------------------------------------- exact match


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        (" 579\n123 + 456 = 579", "579"),
        ("579<|endoftext|>garbage", "579"),
        ("\n\n  42  \nmore text", "42"),
        ("12</s>\n", "12"),
        ("", ""),
    ],
)
def test_first_line_answer(response: str, answer: str):
    assert first_line_answer(response, RewardConfig().stop_strings) == answer


def test_exact_match_scores():
    scorer = RewardScorer(RewardConfig())
    scores = scorer.score_batch(
        ["1+1=", "2+2=", "3+3=", "4+4=", "5+5="],
        ["2", " 4<|endoftext|>", "60", "8 is it", "10\n11"],
        ["2", "4", "6", "8", 10],
    )
    assert scores == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert exact_match("-7 ", "-7") and not exact_match("-7", "7")


def test_exact_match_format_reward():
    scorer = RewardScorer(RewardConfig(format_reward=0.1))
    got = scorer.score_batch(["q"] * 3, ["5", "6", "   "], ["5", "5", "5"])
    assert got == pytest.approx([1.1, 0.1, 0.0])
    assert scorer.score_one("q", "", "5").well_formed is False


def test_format_pattern():
    cfg = RewardConfig(format_reward=-0.5, format_pattern=r"^\d+$")
    scorer = RewardScorer(cfg)
    # the pattern is searched in the whole response: a bare number matches -> penalty
    assert scorer.score_batch(["q", "q"], ["5", "five"], ["5", "5"]) == pytest.approx([0.5, 0.0])


def test_score_samples_objects_and_dicts():
    @dataclass
    class Sample:
        prompt: str
        response: str
        label: str
        metadata: dict = field(default_factory=dict)

    scorer = RewardScorer(RewardConfig())
    samples = [Sample("1+2=", "3", "3"), {"prompt": "1+3=", "response": "5", "label": "4"}]
    assert scorer.score(samples) == [1.0, 0.0]
    assert scorer.score([{"prompt": "p", "response": "3"}]) == [0.0]  # no label: wrong


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="2 prompts, 1 responses and 2 labels"):
        RewardScorer(RewardConfig()).score_batch(["a", "b"], ["1"], ["1", "2"])


# ---------------------------------------------------------------- math


def test_extract_boxed():
    assert extract_boxed(r"so \boxed{\frac{1}{2}}.") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{1} then \boxed{ {a}+{b} }") == "{a}+{b}"
    assert extract_boxed(r"\boxed 5 is it") == "5"
    assert extract_boxed(r"\boxed{unclosed") is None
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    ("response", "answer", "how"),
    [
        (r"First 3, then \boxed{\dfrac{3}{4}}.", r"\dfrac{3}{4}", "boxed"),
        (r"So the answer is $\frac{3}{4}$.", r"\frac{3}{4}", "answer_is"),
        ("Final Answer: 17", "17", "answer_is"),
        ("He buys 12 apples, total 1,234 dollars", "1234", "last_number"),
        ("half of it: 1/2", "1/2", "last_number"),
        ("-3.5 degrees", "-3.5", "last_number"),
        ("no idea", None, "none"),
    ],
)
def test_extract_math_answer(response: str, answer: str | None, how: str):
    assert extract_math_answer(response) == (answer, how)


@pytest.mark.parametrize(
    ("label", "answer", "same"),
    [
        ("0.5", r"\frac{1}{2}", True),
        (r"\frac{1}{2}", "0.5", True),
        (r"\frac12", "1/2", True),
        ("0.75", r"\dfrac{3}{4}", True),
        ("x^2+1", "1+x^2", True),
        (r"\boxed{7}", "7", True),
        ("0.5", r"\frac{1}{3}", False),
        ("34", "43", False),
        ("2", "-2", False),
        ("x^2+1", "x^2-1", False),
    ],
)
def test_verify_answer(label: str, answer: str, same: bool):
    assert verify_answer(label, answer) is same


def test_math_verify_scorer_with_format_reward():
    scorer = RewardScorer(RewardConfig(type="math_verify", format_reward=0.1))
    responses = [
        r"Adding halves gives \boxed{\frac{1}{2}}",  # right, boxed
        "The answer is 0.5.",  # right, stated
        "It is 5 or maybe 1/2",  # right by last number, not well formed
        r"\boxed{\frac{1}{3}}",  # wrong but boxed
        "I give up",
    ]
    details = scorer.score_details(["q"] * 5, responses, ["0.5"] * 5)
    assert [d.score for d in details] == pytest.approx([1.1, 1.1, 1.0, 0.1, 0.0])
    assert [d.correct for d in details] == [True, True, True, False, False]


def test_math_verify_off_the_main_thread_uses_a_helper_process():
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.extend([verify_answer("0.5", r"\frac{2}{4}", 5.0)]))
    t.start()
    t.join(timeout=120)
    assert out == [True]


def test_subprocess_runner_times_out_and_recovers():
    runner = SubprocessRunner()
    try:
        start = time.monotonic()
        assert runner.run(time.sleep, (60,), 1.0, "late") == "late"
        assert time.monotonic() - start < 30
        assert runner.run(abs, (-3,), 60.0, None) == 3  # a fresh helper after the kill
    finally:
        runner.close()


# ---------------------------------------------------------------- custom


def test_custom_reward_float_and_metadata():
    cfg = _load("reward.type=custom", "reward.custom_path=tests.rewards.custom_fns:length_bonus")
    scorer = RewardScorer(cfg)
    got = scorer.score_batch(["ab", "abcd"], ["7 x", "8"], ["7", "7"], [{"bonus": 0.5}, None])
    assert got == pytest.approx([2.0, 0.0])
    assert scorer.score_one("p", "7", "7").correct is None


def test_custom_reward_dict():
    scorer = RewardScorer(
        RewardConfig(type="custom", custom_path="tests.rewards.custom_fns:as_dict")
    )
    res = scorer.score_one("p", "it is 42", "42")
    assert (res.score, res.correct, res.extra) == (2.0, True, {"correct": True, "note": "dict"})
    assert scorer.score_batch(["p"], ["no"], ["42"]) == [-1.0]


def test_custom_reward_dict_without_score():
    scorer = RewardScorer(
        RewardConfig(type="custom", custom_path="tests.rewards.custom_fns:no_score")
    )
    with pytest.raises(ValueError, match="without 'score'"):
        scorer.score_one("p", "r", "l")


def test_custom_reward_from_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def fn(prompt, response, label, metadata):\n    return 0.25\n")
    scorer = RewardScorer(RewardConfig(type="custom", custom_path=f"{f}:fn"))
    assert scorer.score_batch(["p"], ["r"], ["l"]) == [0.25]


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        ("tests.rewards.custom_fns:missing", "has no attribute 'missing'"),
        ("tests.rewards.custom_fns:not_callable", "is not callable"),
        ("tests.rewards.custom_fns:bad_signature", "must accept"),
        ("tests.rewards.custom_fns", "must be 'module:function'"),
        ("/nonexistent/r.py:fn", "does not exist"),
    ],
)
def test_bad_custom_path_is_a_config_error(path: str, why: str):
    with pytest.raises(ConfigError) as e:  # its form on loading, the import before the start
        check_reward(_load("reward.type=custom", f"reward.custom_path={path}"))
    assert "reward.custom_path" in str(e.value) and why in str(e.value)


def test_custom_module_that_fails_on_import(tmp_path):
    f = tmp_path / "broken.py"
    f.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ConfigError, match=r"reward\.custom_path.*RuntimeError: boom"):
        check_reward(_load("reward.type=custom", f"reward.custom_path={f}:fn"))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["reward.type=custom"], "reward.custom_path is required"),
        (["reward.custom_path=tests.rewards.custom_fns:as_dict"], "reward.type=custom"),
        (["reward.format_pattern=(unclosed"], "reward.format_pattern is not a valid regex"),
        (
            [
                "reward.type=custom",
                "reward.custom_path=tests.rewards.custom_fns:as_dict",
                "reward.format_reward=0.1",
            ],
            "reward.format_pattern is required",
        ),
        (["reward.type=bleu"], "reward.type"),
        (["reward.timeout_s=0"], "reward.timeout_s"),
    ],
)
def test_bad_reward_config(overrides: list[str], key: str):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.").replace("(", r"\(")):
        _load(*overrides)
