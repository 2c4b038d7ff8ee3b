"""Reward hooks for slime's ``--custom-rm-path``, scored by Titan's rewards.

slime calls the function named by ``--custom-rm-path`` in two shapes (slime/rollout/rm_hub):
``await fn(args, sample)`` per sample, and ``await fn(args, samples)`` with a list, both under
``--group-rm`` (the whole group at once) and when a custom generate function returns several
samples. Every hook here accepts both and answers a float or a list of floats in order::

    --custom-rm-path adapters.slime.rewards.exact_match
    --custom-rm-path adapters.slime.rewards.math_verify

``exact_match``: the response's first line, cut at Titan's end-of-text markers and at slime's
``--rollout-stop`` strings (slime sends ``no_stop_trim``, so a matched stop string stays in
the response), equals the label. ``math_verify``: a ``\\boxed{}`` (else "answer is X", else
last number) answer equal to the label under math-verify. math-verify runs in a worker thread
(slime's event loop keeps serving), where Titan checks it in a helper process with a
wall-clock limit. Other settings (format reward, timeout, a custom Titan reward)::

    my_rm = make_reward_hook(RewardConfig(type="math_verify", timeout_s=2, format_reward=0.1))
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from titan_rl.rewards import RewardConfig, RewardScorer

__all__ = [
    "RewardHook",
    "exact_match",
    "exact_match_batch",
    "make_reward_hook",
    "math_verify",
    "math_verify_batch",
]

#: ``async fn(args, sample_or_samples, **kwargs) -> float | list[float]``
RewardHook = Callable[..., Awaitable[float | list[float]]]


def _rollout_stops(args: Any) -> tuple[str, ...]:
    stops = getattr(args, "rollout_stop", None) or ()
    if isinstance(stops, str):
        stops = (stops,)
    return tuple(str(s) for s in stops if s)


@functools.lru_cache(maxsize=32)
def _scorer(cfg_json: str, extra_stops: tuple[str, ...]) -> RewardScorer:
    cfg = RewardConfig.model_validate_json(cfg_json)
    if extra_stops:
        stops = list(dict.fromkeys([*cfg.stop_strings, *extra_stops]))
        cfg = cfg.model_copy(update={"stop_strings": stops})
    return RewardScorer(cfg)


def make_reward_hook(cfg: RewardConfig, *, offload: bool | None = None) -> RewardHook:
    """A slime reward hook scoring with ``RewardScorer(cfg)``.

    ``offload``: score in a worker thread (default: for math-verify and custom rewards, whose
    cost is unbounded; exact match is cheap and runs inline).
    """
    cfg_json = cfg.model_dump_json()
    in_thread = cfg.type != "exact_match" if offload is None else offload

    async def hook(args: Any, sample: Any, **kwargs: Any) -> float | list[float]:
        scorer = _scorer(cfg_json, _rollout_stops(args) if cfg.type == "exact_match" else ())
        batched = isinstance(sample, list | tuple)
        samples: Sequence[Any] = list(sample) if batched else [sample]
        if in_thread:
            scores = await asyncio.to_thread(scorer.score, samples)
        else:
            scores = scorer.score(samples)
        return [float(s) for s in scores] if batched else float(scores[0])

    hook.__doc__ = f"slime reward hook: Titan's {cfg.type} reward (one sample or a list)."
    return hook


def _batch_only(hook: RewardHook, name: str) -> RewardHook:
    async def batched(args: Any, samples: Sequence[Any], **kwargs: Any) -> list[float]:
        if not isinstance(samples, list | tuple):
            raise TypeError(f"{name} scores a list of samples (slime's --group-rm form)")
        out = await hook(args, list(samples), **kwargs)
        assert isinstance(out, list)
        return out

    batched.__name__ = batched.__qualname__ = name
    batched.__doc__ = f"slime group reward hook: ``await {name}(args, samples) -> list[float]``."
    return batched


exact_match: RewardHook = make_reward_hook(RewardConfig(type="exact_match"))
exact_match.__name__ = exact_match.__qualname__ = "exact_match"
math_verify: RewardHook = make_reward_hook(RewardConfig(type="math_verify"))
math_verify.__name__ = math_verify.__qualname__ = "math_verify"
exact_match_batch: RewardHook = _batch_only(exact_match, "exact_match_batch")
math_verify_batch: RewardHook = _batch_only(math_verify, "math_verify_batch")
