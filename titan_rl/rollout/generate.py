"""Group rollout: ``n_samples_per_prompt`` responses per prompt, rewards, dynamic filter."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from titan_rl.config import RolloutConfig
from titan_rl.data import Prompt
from titan_rl.rollout.client import GenerateOutput, SGLangClient
from titan_rl.sample import Sample, Status


@dataclass
class RolloutResult:
    samples: list[Sample]
    groups_generated: int
    groups_filtered: int
    truncated: int
    #: a fingerprint of the prompts drawn for the step (over-sampled ones included)
    prompt_hash: str = ""


def prompt_fingerprint(prompts: list[Prompt]) -> str:
    """16 hex digits identifying the prompts and their order (to compare runs)."""
    h = hashlib.blake2b(digest_size=8)
    for p in prompts:
        h.update(p.text.encode())
        h.update(b"\0")
        h.update(p.label.encode())
        h.update(b"\1")
    return h.hexdigest()


def _sample_from(prompt: Prompt, tokens: list[int], out: GenerateOutput, g: int, i: int) -> Sample:
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
    )


async def generate_groups(
    client: SGLangClient,
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    cfg: RolloutConfig,
    stop_token_ids: list[int],
    reward_fn: Callable[[list[Sample]], list[float]],
    want_groups: int,
    seed: int,
) -> RolloutResult:
    """Generate groups for ``prompts``; keep the first ``want_groups`` that pass the filter.

    With over-sampling, groups still running once enough have passed are aborted.
    """
    params = {
        "max_new_tokens": cfg.max_response_len,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "n": cfg.n_samples_per_prompt,
        "stop_token_ids": stop_token_ids,
    }
    kept: list[list[Sample]] = []
    stats = {"generated": 0, "filtered": 0}
    enough = asyncio.Event()

    async def one(g: int, prompt: Prompt) -> None:
        tokens = encode(prompt.text)
        outs = await client.generate(
            tokens, {**params, "sampling_seed": seed * 1_000_003 + g}, return_logprob=True
        )
        outs = outs if isinstance(outs, list) else [outs]
        group = [_sample_from(prompt, tokens, o, g, i) for i, o in enumerate(outs)]
        for s in group:
            s.response = decode(s.response_tokens)
        for s, r in zip(group, reward_fn(group), strict=True):
            s.reward = r
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
        await client.abort_request(abort_all=True)
        for t in leftovers:
            t.cancel()
    results = await all_done
    waiter.cancel()
    errors = [
        r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)
    ]
    if errors and len(kept) < want_groups:
        raise errors[0]
    samples = [s for group in kept for s in group]
    return RolloutResult(
        samples=samples,
        groups_generated=stats["generated"],
        groups_filtered=stats["filtered"],
        truncated=sum(s.status == Status.TRUNCATED for s in samples),
        prompt_hash=prompt_fingerprint(prompts),
    )


async def evaluate(
    client: SGLangClient,
    prompts: list[Prompt],
    encode: Callable[[str], list[int]],
    decode: Callable[[list[int]], str],
    max_new_tokens: int,
    stop_token_ids: list[int],
    reward_fn: Callable[[list[Sample]], list[float]],
) -> float:
    """Greedy accuracy on held-out prompts: the share of answers the reward function marks
    ``correct`` (a sample it leaves unmarked counts as correct at a full score, >= 1)."""
    params = {
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "stop_token_ids": stop_token_ids,
    }

    async def one(g: int, prompt: Prompt) -> Sample:
        tokens = encode(prompt.text)
        out = await client.generate(tokens, params)
        out = out[0] if isinstance(out, list) else out
        s = _sample_from(prompt, tokens, out, g, 0)
        s.response = decode(s.response_tokens)
        return s

    samples = await asyncio.gather(*[one(g, p) for g, p in enumerate(prompts)])
    rewards = reward_fn(list(samples))
    hits = [
        r >= 1.0 if s.correct is None else s.correct for s, r in zip(samples, rewards, strict=True)
    ]
    return sum(hits) / max(1, len(hits))
