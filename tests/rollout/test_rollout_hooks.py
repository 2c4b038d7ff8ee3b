"""``rollout.generate_fn``: the hook is loaded and checked where the config enters, called
per sample (n=1, a seed each) or per group, and used by generate_groups and evaluate."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from multiturn_scripted import EOS, EOS_STOP, ScriptedEngine, Turn, decode, encode, stop_at
from pydantic import ValidationError

from titan_core.config import ConfigError
from titan_rl.config import GRPOConfig, RolloutConfig
from titan_rl.data import Prompt
from titan_rl.preflight import check_generate_fn
from titan_rl.rollout.generate import (
    evaluate,
    generate_groups,
    group_seed,
    resolve_generate_fn,
    sample_seed,
    single_turn,
)
from titan_rl.rollout.hooks import is_per_group, load_generate_fn
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample, Status

HOOKS = Path(__file__).with_name("generate_hooks.py")


def hook(name: str) -> str:
    return f"{HOOKS}:{name}"


async def exact(samples: list[Sample]) -> RewardCounts:
    for s in samples:
        s.reward = float(s.response.strip() == s.label)
        s.correct = s.reward == 1.0
    return RewardCounts()


def rollout(engine: ScriptedEngine, cfg: RolloutConfig, prompts: list[str], seed: int = 5) -> Any:
    return asyncio.run(
        generate_groups(
            engine,
            [Prompt(p, "3", {"p": p}) for p in prompts],
            encode,
            decode,
            cfg,
            [EOS],
            exact,
            want_groups=len(prompts),
            seed=seed,
        )  # fmt: skip
    )


def test_the_default_is_the_single_turn_group_request() -> None:
    assert resolve_generate_fn(RolloutConfig()) is single_turn and is_per_group(single_turn)


def test_a_per_sample_hook_is_called_n_times_with_n_1_and_a_seed_each() -> None:
    mod = load_generate_fn(hook("one_each")).__globals__
    mod["CALLS"].clear()
    cfg = RolloutConfig(n_samples_per_prompt=3, max_response_len=4, generate_fn=hook("one_each"))
    engine = ScriptedEngine(respond=lambda ids: Turn([*encode("3"), EOS], EOS_STOP))
    result = rollout(engine, cfg, ["a", "b"])
    calls = mod["CALLS"]
    assert sorted(i for i, _ in calls) == [0, 0, 1, 1, 2, 2]
    assert {p["n"] for _, p in calls} == {1} and {p["max_new_tokens"] for _, p in calls} == {4}
    seeds = [p["sampling_seed"] for _, p in calls]
    assert len(set(seeds)) == 6
    assert set(seeds) == {sample_seed(5, g, i) for g in range(2) for i in range(3)}
    assert len(engine.requests) == 6 and all(r["params"]["n"] == 1 for r in engine.requests)
    assert [(s.group_index, s.index) for s in result.samples] == [
        (g, i) for g in range(2) for i in range(3)
    ]
    assert all(s.metadata == {"p": s.prompt, "hook": "one_each"} for s in result.samples)
    assert all(s.response == "3" and s.reward == 1.0 for s in result.samples)  # filled, scored


def test_sample_seeds_differ_by_step_group_and_index() -> None:
    seeds = {sample_seed(step, g, i) for step in range(3) for g in range(4) for i in range(4)}
    assert len(seeds) == 48 and all(0 <= s < 2**31 for s in seeds)
    assert sample_seed(1, 2, 3) == sample_seed(1, 2, 3)


def test_group_requests_never_share_a_copy_seed() -> None:
    # copy i of a group's n-sample request samples with group_seed + i: across the groups of
    # consecutive steps those ranges must not meet (seed * k + g made copy i + 1 of group g
    # and copy i of group g + 1 one random stream)
    n = 16
    seeds = [
        group_seed(step, g) + i for step in range(100, 103) for g in range(64) for i in range(n)
    ]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2**63 for s in seeds)
    assert group_seed(7, 3) == group_seed(7, 3)


def test_a_multi_turn_hook_from_the_config_drives_the_grpo_rollout() -> None:
    def respond(ids: list[int]) -> Turn:
        text = decode(ids)
        if text.endswith("=3"):
            return Turn([*encode("3"), EOS], EOS_STOP)
        return Turn(encode("CALC(1+2)"), stop_at(")"))

    cfg = RolloutConfig(
        n_samples_per_prompt=2, max_response_len=16, generate_fn=hook("with_calculator")
    )
    engine = ScriptedEngine(respond=respond)
    result = rollout(engine, cfg, ["1+2="])
    assert len(result.samples) == 2 and len(engine.requests) == 4
    for s in result.samples:
        assert s.response_tokens == encode("CALC(1+2)=3") + [*encode("3"), EOS]
        assert s.loss_mask == [1] * 9 + [0] * 2 + [1] * 2
        assert s.metadata["tool_calls"] == [{"name": "calc", "args": "1+2", "result": "3"}]
        assert s.response == "CALC(1+2)=33" and s.status == Status.COMPLETED


def test_evaluate_uses_the_hook() -> None:
    def respond(ids: list[int]) -> Turn:
        if decode(ids).endswith("=3"):
            return Turn([*encode("3"), EOS], EOS_STOP)
        return Turn(encode("CALC(1+2)"), stop_at(")"))

    cfg = RolloutConfig(generate_fn=hook("with_calculator"))

    async def label_in_answer(samples: list[Sample]) -> RewardCounts:
        for s in samples:
            s.correct = s.response.endswith(s.label)
        return RewardCounts()

    engine = ScriptedEngine(respond=respond)
    acc = asyncio.run(
        evaluate(
            engine,
            [Prompt("x", "3", {}), Prompt("y", "4", {})],
            encode,
            decode,
            16,
            [EOS],
            label_in_answer,
            cfg=cfg,
        )  # fmt: skip
    )
    assert acc == 0.5
    assert len(engine.requests) == 4
    assert {r["params"]["temperature"] for r in engine.requests} == {0.0}
    assert all("sampling_seed" not in r["params"] for r in engine.requests)


def test_a_hook_returning_the_wrong_number_of_samples_is_an_error_naming_it() -> None:
    cfg = RolloutConfig(n_samples_per_prompt=2, generate_fn=hook("too_few"))
    with pytest.raises(ValueError, match=r"too_few returned 1 samples where 2 were expected"):
        rollout(ScriptedEngine(), cfg, ["a"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (hook("not_async"), "must be an async function"),
        (hook("wrong_arity"), r"must accept \(ctx, sample, sampling_params\)"),
        (hook("missing"), "has no attribute 'missing'"),
        ("no_such_module_xyz:fn", "cannot import 'no_such_module_xyz'"),
        ("nowhere/hooks.py:fn", "does not exist"),
    ],
)
def test_a_hook_that_cannot_be_used_is_a_config_error_naming_the_key(
    spec: str, message: str
) -> None:
    cfg = GRPOConfig(rollout={"generate_fn": spec})
    with pytest.raises(ConfigError, match=rf"rollout\.generate_fn .*{message}"):
        check_generate_fn(cfg)


def test_the_key_must_name_a_function() -> None:
    with pytest.raises(ValidationError, match=r"rollout\.generate_fn 'agent' must be"):
        RolloutConfig(generate_fn="agent")
    check_generate_fn(GRPOConfig())  # unset: nothing to check
