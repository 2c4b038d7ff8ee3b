"""Rollout hooks named by ``rollout.generate_fn`` in tests/rollout/test_rollout_hooks.py."""

from __future__ import annotations

import dataclasses
from typing import Any

from titan_rl.rollout.hooks import RolloutContext, per_group
from titan_rl.rollout.multiturn import run_multi_turn
from titan_rl.rollout.tools import ToolEnv, calculator_tool
from titan_rl.sample import Sample, Status

#: (sample index, sampling params) of each call of :func:`one_each`
CALLS: list[tuple[int, dict[str, Any]]] = []


async def one_each(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """Called per sample: one request with n=1, the response tagged with the hook's name."""
    CALLS.append((sample.index, dict(sampling_params)))
    (out,) = await ctx.generate(sample.prompt_tokens, sampling_params)
    return dataclasses.replace(
        sample,
        response_tokens=list(out.output_ids),
        rollout_log_probs=list(out.output_logprobs or []),
        status=Status.COMPLETED,
        weight_version=out.weight_version or "",
        metadata={**sample.metadata, "hook": "one_each"},
    )


async def with_calculator(
    ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]
) -> Sample:
    return await run_multi_turn(
        ctx, sample, sampling_params, ToolEnv([calculator_tool()]), max_turns=3,
        max_total_tokens=64,
    )  # fmt: skip


@per_group
async def too_few(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> list:
    return [sample]


def not_async(ctx: RolloutContext, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    return sample


async def wrong_arity(ctx: RolloutContext) -> Sample:
    raise AssertionError("never called")
