"""Partial rollouts (``rollout.partial``): what a step's rollout leaves running is carried,
not thrown away.

Once a step has its groups, the generations still running are aborted (SGLang's
``abort_request``) and come back with the tokens they have; their groups are carried to the
next rollout, which starts them first: each aborted sample is continued from its prompt and
the tokens it has (one request, n = 1, the rest of the response budget) on the weights the
engines serve then. Its new tokens are appended with their logprobs and the version that
produced them (``Sample.weight_versions``), so the rollout correction (TIS / MIS / IcePop)
weighs each token against the logprobs of the policy that sampled it. A group that finished
after the step had enough is carried scored and taken as it is.

The carried groups go in every checkpoint (:meth:`PartialBuffer.state`), so a resumed run
continues the generations that were in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from titan_rl.data import Prompt
from titan_rl.rollout.hooks import RolloutContext
from titan_rl.rollout.outputs import finish_status, routed_experts_tensor
from titan_rl.sample import Sample, Status


@dataclass
class CarriedGroup:
    """A group a rollout left: some samples aborted mid-generation (continued by the next
    rollout), or all finished and ``scored`` (taken as they are)."""

    prompt: Prompt
    samples: list[Sample]
    scored: bool = False

    @property
    def unfinished(self) -> int:
        return sum(s.status == Status.ABORTED for s in self.samples)


async def continue_sample(
    ctx: RolloutContext, sample: Sample, params: dict[str, Any], seed: int | None
) -> Sample:
    """``sample`` (aborted) continued from its prompt and response so far, within what is
    left of ``params["max_new_tokens"]``; its tokens, logprobs and their versions appended."""
    budget = int(params["max_new_tokens"]) - sample.response_length
    if budget <= 0:
        return dataclasses.replace(sample, status=Status.TRUNCATED)
    sp = {**params, "n": 1, "max_new_tokens": budget}
    if seed is not None:
        sp["sampling_seed"] = seed
    (out,) = await ctx.generate(sample.tokens, sp)
    ids = list(out.output_ids)
    version = out.weight_version or ""
    old_lps, new_lps = sample.rollout_log_probs, out.output_logprobs or []
    have = len(old_lps) == sample.response_length and len(new_lps) == len(ids)
    routed = routed_experts_tensor(out, ctx.routing_layers)  # the whole sequence, this pass
    response = sample.response_tokens + ids
    return dataclasses.replace(
        sample,
        response_tokens=response,
        response=ctx.decode(response),
        rollout_log_probs=[*old_lps, *new_lps] if have else [],
        weight_versions=sample.token_versions() + [version] * len(ids),
        weight_version=version or sample.weight_version,
        status=finish_status(out),
        metadata={**sample.metadata, "continued": int(sample.metadata.get("continued", 0)) + 1},
        rollout_routed_experts=routed if routed is not None else sample.rollout_routed_experts,
    )


async def continue_group(
    ctx: RolloutContext, group: CarriedGroup, params: dict[str, Any], seeds: Sequence[int | None]
) -> list[Sample]:
    """The group with each aborted sample continued (concurrently; ``seeds[i]`` for sample
    i); the finished ones as they are."""
    calls = {
        i: asyncio.ensure_future(continue_sample(ctx, s, params, seeds[i]))
        for i, s in enumerate(group.samples)
        if s.status == Status.ABORTED
    }
    try:
        done = dict(zip(calls, await asyncio.gather(*calls.values()), strict=True))
    except BaseException:
        for c in calls.values():
            c.cancel()
        raise
    return [done.get(i, s) for i, s in enumerate(group.samples)]


def _sample_state(s: Sample) -> dict[str, Any]:
    return {**dataclasses.asdict(s), "status": str(s.status)}  # asdict copies deeply


def _sample_from_state(state: dict[str, Any]) -> Sample:
    return Sample(**{**state, "status": Status(state["status"])})


class PartialBuffer:
    """The groups carried from one rollout to the next, oldest first."""

    def __init__(self) -> None:
        self.groups: list[CarriedGroup] = []

    def take(self) -> list[CarriedGroup]:
        """Every carried group (the buffer is left empty)."""
        groups, self.groups = self.groups, []
        return groups

    def put(self, groups: Sequence[CarriedGroup]) -> None:
        self.groups.extend(groups)

    def state(self) -> list[dict[str, Any]]:
        """The carried groups as plain values (and the routed-experts tensors), for a
        checkpoint."""
        return [
            {
                "prompt": dataclasses.asdict(g.prompt),
                "samples": [_sample_state(s) for s in g.samples],
                "scored": g.scored,
            }
            for g in self.groups
        ]

    def restore(self, state: Sequence[dict[str, Any]]) -> None:
        self.groups = [
            CarriedGroup(
                Prompt(**g["prompt"]), [_sample_from_state(s) for s in g["samples"]], g["scored"]
            )
            for g in state
        ]
