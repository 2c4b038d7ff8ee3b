"""Group rollout: ``n_samples_per_prompt`` responses per prompt, rewards, dynamic filter.

Rewards are scored by an async ``reward_fn`` (``titan_rl.rollout.rewarding.SampleRewarder``
in the GRPO loop) that sets each sample's ``reward`` and ``correct`` and returns what it
counted; groups are scored concurrently, off the event loop.

Each sample records the weight version its engine generated it with; a :class:`VersionCheck`
refuses responses from another version than the policy's (an engine restarted on the run's
start-up weights) and sends their request again once the engines serve the current one.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rewards.errors import RewardError
from titan_rl.rollout.engine_api import EngineClient, EngineError, GenerateOutput
from titan_rl.rollout.rewarding import RewardCounts
from titan_rl.sample import Sample, Status

log = logging.getLogger(__name__)

#: scores samples in place (``reward``, ``correct``; status FAILED: left out of the loss)
RewardFn = Callable[[list[Sample]], Awaitable[RewardCounts]]

#: re-sends of one request refused for its weight version before the rollout gives up
MAX_RESENDS = 5


class StaleVersionError(RuntimeError):
    """Responses kept coming from a weight version the rollout does not accept."""


@dataclass(frozen=True)
class VersionCheck:
    """The weight versions a rollout accepts, and what becomes of a response from another.

    ``resend``: the response is refused and its request sent again once ``wait_current``
    returns (the engines then serve an accepted version); ``keep``: it is kept. Both count it.
    """

    accepted: frozenset[str]
    on_stale: Literal["resend", "keep"] = "resend"
    wait_current: Callable[[], Awaitable[None]] | None = None

    def stale(self, outs: Sequence[GenerateOutput]) -> int:
        return sum((o.weight_version or "") not in self.accepted for o in outs)


async def _generate_checked(
    client: EngineClient,
    tokens: list[int],
    params: dict[str, Any],
    versions: VersionCheck | None,
    stats: dict[str, int],
    **kw: Any,
) -> list[GenerateOutput]:
    """One request's outputs, generated with an accepted weight version (unless ``keep``)."""
    sent = 0
    while True:
        outs = await client.generate(tokens, params, **kw)
        outs = outs if isinstance(outs, list) else [outs]
        stale = 0 if versions is None else versions.stale(outs)
        stats["stale"] += stale
        if not stale or versions is None or versions.on_stale == "keep":
            return outs
        if sent == MAX_RESENDS:
            break
        sent += 1
        log.warning(
            "refused %d responses generated with weight version %s (accepted: %s); sending again",
            stale, sorted({str(o.weight_version) for o in outs}), sorted(versions.accepted),
        )  # fmt: skip
        if versions.wait_current is not None:
            await versions.wait_current()
    raise StaleVersionError(
        f"an engine answered with weight version(s) {sorted({str(o.weight_version) for o in outs})} "
        f"{MAX_RESENDS + 1} times where the policy's is {sorted(versions.accepted)}; check that "
        "every engine receives the weight syncs"
    )


@dataclass
class RolloutResult:
    samples: list[Sample]
    groups_generated: int
    groups_filtered: int
    truncated: int
    #: a fingerprint of the prompts drawn for the step (over-sampled ones included)
    prompt_hash: str = ""
    #: samples of the generated groups whose reward call timed out (reward.timeout_s)
    reward_timeouts: int = 0
    #: samples of the generated groups dropped for an invalid reward (reward.on_invalid)
    reward_invalid: int = 0
    #: responses generated with a weight version the rollout does not accept (refused and
    #: generated again, or kept under rollout.on_stale_version=keep)
    stale_samples: int = 0


def prompt_fingerprint(prompts: list[Prompt]) -> str:
    """16 hex digits identifying the prompts and their order (to compare runs)."""
    h = hashlib.blake2b(digest_size=8)
    for p in prompts:
        h.update(p.text.encode())
        h.update(b"\0")
        h.update(p.label.encode())
        h.update(b"\1")
    return h.hexdigest()


def _fill_dropped(group: list[Sample]) -> None:
    """A dropped (FAILED) sample takes the mean reward of its group's scored ones, so the
    group baseline is theirs; it carries no loss (pack_samples masks it)."""
    scored = [s.reward for s in group if s.status != Status.FAILED]
    fill = sum(scored) / len(scored) if scored else 0.0
    for s in group:
        if s.status == Status.FAILED:
            s.reward = fill


def _routed_experts(out: GenerateOutput, num_layers: int | None) -> torch.Tensor | None:
    """The answer's routed experts ``[tokens, num_layers, top_k]`` (None when not asked, or
    for a request aborted before it ran)."""
    if num_layers is None:
        return None
    routed = out.routed_experts(num_layers)
    if routed is None and out.aborted:  # aborted while queued: the prompt never ran
        return None
    if routed is None:
        raise EngineError(
            "rollout.return_routed_experts is on but the engine answered no routed_experts; "
            "serve an MoE model (SGLang: launched with --enable-return-routed-experts)"
        )
    return torch.from_numpy(routed)


def _sample_from(
    prompt: Prompt,
    tokens: list[int],
    out: GenerateOutput,
    g: int,
    i: int,
    routing_layers: int | None = None,
) -> Sample:
    status = {
        "length": Status.TRUNCATED,
        "abort": Status.ABORTED,
    }.get(out.finish_type, Status.COMPLETED)
    return Sample(
        group_index=g,
        index=i,
        prompt=prompt.text,
        prompt_tokens=tokens,
        label=prompt.label,
        response_tokens=list(out.output_ids),
        rollout_log_probs=list(out.output_logprobs or []),
        status=status,
        weight_version=out.weight_version or "",
        metadata=dict(prompt.metadata),
        rollout_routed_experts=_routed_experts(out, routing_layers),
    )


async def generate_groups(
    client: EngineClient,
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    cfg: RolloutConfig,
    stop_token_ids: list[int],
    reward_fn: RewardFn,
    want_groups: int,
    seed: int,
    versions: VersionCheck | None = None,
    num_layers: int | None = None,
) -> RolloutResult:
    """Generate groups for ``prompts``; keep the first ``want_groups`` that pass the filter.

    With over-sampling, groups still running once enough have passed are aborted. A
    RewardError (an invalid reward under reward.on_invalid=error) fails the rollout even
    when enough other groups passed. ``versions``: see :class:`VersionCheck`.
    ``num_layers``: the model's layers, to shape the routed experts that
    ``cfg.return_routed_experts`` asks for (required then).
    """
    if cfg.return_routed_experts and num_layers is None:
        raise ValueError("rollout.return_routed_experts needs the model's num_layers")
    routing_layers = num_layers if cfg.return_routed_experts else None
    routing = {"return_routed_experts": True} if cfg.return_routed_experts else {}
    params = {
        "max_new_tokens": cfg.max_response_len,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "n": cfg.n_samples_per_prompt,
        "stop_token_ids": stop_token_ids,
    }
    kept: list[list[Sample]] = []
    stats = {"generated": 0, "filtered": 0, "stale": 0}
    counts = RewardCounts()
    enough = asyncio.Event()

    async def one(g: int, prompt: Prompt) -> None:
        tokens = encode(prompt.text)
        outs = await _generate_checked(
            client, tokens, {**params, "sampling_seed": seed * 1_000_003 + g}, versions, stats,
            return_logprob=True, **routing,
        )  # fmt: skip
        group = [_sample_from(prompt, tokens, o, g, i, routing_layers) for i, o in enumerate(outs)]
        for s in group:
            s.response = decode(s.response_tokens)
        counts.add(await reward_fn(group))
        _fill_dropped(group)
        stats["generated"] += 1
        if cfg.dynamic_filter and len({s.reward for s in group}) == 1:
            stats["filtered"] += 1
            return
        if len(kept) < want_groups:
            kept.append(group)
            if len(kept) == want_groups:
                enough.set()

    tasks = [asyncio.create_task(one(g, p)) for g, p in enumerate(prompts)]
    waiter = asyncio.create_task(enough.wait())
    all_done = asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.wait([waiter, all_done], return_when=asyncio.FIRST_COMPLETED)
    leftovers = [t for t in tasks if not t.done()]
    if leftovers:
        try:  # one attempt: an engine that is down has nothing running to abort
            await client.abort_request(abort_all=True, retries=0)
        except EngineError as e:
            log.warning("could not abort the leftover requests: %s", e)
        for t in leftovers:
            t.cancel()
    results = await all_done
    waiter.cancel()
    errors = [
        r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)
    ]
    reward_errors = [e for e in errors if isinstance(e, RewardError)]
    if reward_errors:
        raise reward_errors[0]
    if errors and len(kept) < want_groups:
        raise errors[0]
    samples = [s for group in kept for s in group]
    return RolloutResult(
        samples=samples,
        groups_generated=stats["generated"],
        groups_filtered=stats["filtered"],
        truncated=sum(s.status == Status.TRUNCATED for s in samples),
        prompt_hash=prompt_fingerprint(prompts),
        reward_timeouts=counts.timeouts,
        reward_invalid=counts.invalid,
        stale_samples=stats["stale"],
    )


async def evaluate(
    client: EngineClient,
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    stop_token_ids: list[int],
    reward_fn: RewardFn,
    versions: VersionCheck | None = None,
) -> float:
    """Greedy accuracy on held-out prompts: the share of answers the reward function marks
    ``correct`` (a sample it leaves unmarked counts as correct at a full score, >= 1); a
    dropped one (invalid reward) counts as wrong."""
    params = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": stop_token_ids,
    }

    stats = {"stale": 0}

    async def one(g: int, prompt: Prompt) -> Sample:
        tokens = encode(prompt.text)
        (out,) = await _generate_checked(client, tokens, params, versions, stats)
        s = _sample_from(prompt, tokens, out, g, 0)
        s.response = decode(s.response_tokens)
        return s

    samples = list(await asyncio.gather(*[one(g, p) for g, p in enumerate(prompts)]))
    await reward_fn(samples)
    hits = [
        s.status != Status.FAILED and (s.reward >= 1.0 if s.correct is None else s.correct)
        for s in samples
    ]
    return sum(hits) / max(1, len(hits))
