"""Generation under a weight-version check: what the rollout (and every rollout hook, through
``RolloutContext.generate``) sends to an engine.

Each sample records the weight version its engine generated it with; a :class:`VersionCheck`
refuses responses from another version than the policy's (an engine restarted on the run's
start-up weights) and sends their request again once the engines serve the current one.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from titan_rl.rollout.engine_api import EngineClient, GenerateOutput

log = logging.getLogger(__name__)

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


async def generate_checked(
    client: EngineClient,
    tokens: list[int],
    params: dict[str, Any],
    versions: VersionCheck | None,
    stats: dict[str, int],
    **kw: Any,
) -> list[GenerateOutput]:
    """One request's outputs, generated with an accepted weight version (unless ``keep``);
    ``stats["stale"]`` counts the responses from another version."""
    sent = 0
    while True:
        outs = await client.generate(tokens, params, **kw)
        outs = outs if isinstance(outs, list) else [outs]
        stale = 0 if versions is None else versions.stale(outs)
        stats["stale"] = stats.get("stale", 0) + stale
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
