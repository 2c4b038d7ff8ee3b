"""Engines that die during a slime / miles run come back on the current weights, and no
sample generated on other weights is trained as on-policy: the main job's recovery
(``titan_rl.actors.recovery.EngineRecovery``) in the rollout manager's process.

An engine's supervisor restarts a dead server on the start-up weights. The rollout manager
(``adapters.common.rollout.TitanEngines``) holds the recovery of its engines; the trainer
ranks tell it each synced version (``set_weight_version``), and it asks them to resync a
restarted engine (``resync_engines`` on every rank). During a rollout or an evaluation
(:func:`adapters.common.rollout.generate_and_score`) the recovery's checks run beside the
requests (``EngineRecovery.guard``), and a sample whose response reports a weight version
the rollout does not accept is sent again, from what it was before, once an engine serves
the current weights; ``rollout/stale_resent`` counts them.

One manager per process (a Ray actor), so the recovery of the running rollout is this
module's: the framework's rollout functions have slime's / miles' signatures and cannot
carry it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_rl.actors.recovery import EngineRecovery

_active: EngineRecovery | None = None
_stale_resent = 0


def install(recovery: EngineRecovery | None) -> None:
    """``recovery`` watches this process's rollouts (None: no engines of this run's own,
    e.g. ``--rollout-external``)."""
    global _active
    _active = recovery


def active() -> EngineRecovery | None:
    return _active


def is_current(sample: Any, recovery: EngineRecovery) -> bool:
    """The sample's last response came from weights the rollout accepts (a sample whose
    generate hook records no version cannot be checked, and counts as current)."""
    versions = getattr(sample, "weight_versions", None) or []
    return not versions or str(versions[-1]) in recovery.accepted


def note_resent() -> None:
    global _stale_resent
    _stale_resent += 1


def take_resent() -> int:
    """Samples sent again since the last call (their response was on other weights)."""
    global _stale_resent
    n, _stale_resent = _stale_resent, 0
    return n
