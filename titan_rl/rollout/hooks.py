"""The rollout hook (``rollout.generate_fn``, slime's custom-generate shape) and what it is
given.

A hook is ``async fn(ctx: RolloutContext, sample: Sample, sampling_params: dict) ->
Sample | list[Sample]``, called once per sample (``sampling_params["n"] == 1``, each call
with its own ``sampling_seed``), or once per prompt when decorated with :func:`per_group`
(``n == rollout.n_samples_per_prompt``; it returns that many samples).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from titan_rl import user_code
from titan_rl.rollout.engine_api import EngineClient, GenerateOutput
from titan_rl.rollout.versions import VersionCheck, generate_checked

if TYPE_CHECKING:
    from titan_rl.config import RolloutConfig
    from titan_rl.sample import Sample

#: the config key naming a hook
KEY = "rollout.generate_fn"
EXAMPLE = "my_pkg.agent:generate"

GenerateFn = Callable[["RolloutContext", "Sample", dict[str, Any]], Awaitable[Any]]

_PER_GROUP = "__titan_per_group__"


def per_group(fn: GenerateFn) -> GenerateFn:
    """Mark ``fn`` as called once per prompt with ``n`` = the group size (one request with n
    completions, as the built-in single-turn rollout sends)."""
    setattr(fn, _PER_GROUP, True)
    return fn


def is_per_group(fn: GenerateFn) -> bool:
    return bool(getattr(fn, _PER_GROUP, False))


@dataclass(frozen=True)
class RolloutContext:
    """What a hook may use: the engine, the tokenizer, the rollout settings, and
    :meth:`generate`, which applies the weight-version check and the routing the rollout
    asks for (so a hook's samples carry the same guarantees as the built-in ones)."""

    client: EngineClient
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    cfg: RolloutConfig
    stop_token_ids: list[int]
    versions: VersionCheck | None = None
    #: the model's layers when ``cfg.return_routed_experts`` (the shape of routed experts)
    routing_layers: int | None = None
    #: counters the rollout reports (``stale``: responses from another weight version)
    stats: dict[str, int] = field(default_factory=lambda: {"stale": 0})

    async def generate(
        self, tokens: list[int], params: dict[str, Any], **kw: Any
    ) -> list[GenerateOutput]:
        """The engine's outputs for ``tokens`` (a list of ``params["n"]``), with logprobs,
        generated with an accepted weight version."""
        if self.routing_layers is not None:
            kw.setdefault("return_routed_experts", True)
        kw.setdefault("return_logprob", True)
        return await generate_checked(self.client, tokens, params, self.versions, self.stats, **kw)


def split_spec(spec: str) -> tuple[str, str]:
    """``spec`` as (module or file, function), importing nothing; ValueError naming the key."""
    return user_code.split_spec(spec, KEY, EXAMPLE)


def load_generate_fn(spec: str) -> GenerateFn:
    """The async function ``spec`` names; ValueError naming the key when it cannot be
    imported or is not an ``async def`` taking (ctx, sample, sampling_params)."""
    attr, fn = user_code.load_attr(spec, KEY, EXAMPLE)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(
            f"{KEY} {spec!r}: {attr!r} must be an async function "
            "(async def fn(ctx, sample, sampling_params))"
        )
    try:
        inspect.signature(fn).bind(None, None, {})
    except TypeError:
        raise ValueError(
            f"{KEY} {spec!r}: {attr} must accept (ctx, sample, sampling_params)"
        ) from None
    return fn
