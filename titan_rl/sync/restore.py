"""Restore after a failed sync: an engine never serves a half update as new.

An engine that failed during a sync keeps its old ``weight_version``; if it had already
applied buckets, it is restored from the last full version on disk when one is known (the
engine's start-up weights or the last disk sync: its *restore point*), and otherwise left
paused. With ``supervised`` engines (the GRPO job: a supervisor restarts a dead engine and
the driver resyncs it, titan_rl/actors/recovery.py) an engine that became unreachable during
a sync is *lost*, not a failure: it is left to its supervisor and forgotten.
"""

from __future__ import annotations

import logging

from titan_rl.sync.transports.base import Engine, Transport, describe

log = logging.getLogger(__name__)


class RestorePoints:
    """Per engine URL, an HF directory holding the weights the engine serves now (None: no
    full version on disk is known), and what brings a failed engine back to it."""

    def __init__(self, initial_version: str) -> None:
        #: the version an engine reports while it serves its start-up weights
        self.initial_version = initial_version
        self.paths: dict[str, str | None] = {}

    async def remember(self, engines: list[Engine]) -> None:
        """On first contact, an engine still on its start-up version serves its model_path."""
        for e in engines:
            if e.url in self.paths:
                continue
            try:
                info = await e.client.get_model_info()
            except Exception:
                info = {}
            fresh = str(info.get("weight_version")) == self.initial_version
            self.paths[e.url] = info.get("model_path") if fresh else None

    def synced(self, url: str, path: str | None) -> None:
        """``url`` took a full sync; ``path``: where that version is on disk, if anywhere."""
        self.paths[url] = path

    def forget(self, url: str) -> None:
        """A restarted engine: no restore point but its start-up weights (asked again)."""
        self.paths.pop(url, None)

    async def recover(self, e: Engine, tr: Transport, reason: str) -> str:
        """Bring a failed engine back to its old weights (and version), or keep it paused;
        ``reason`` with what became of the engine."""
        if e.applied == 0 or (not tr.incremental and "load" not in reason):
            return f"{reason} (engine unchanged: old weights and version)"
        path = self.paths.get(e.url)
        if path:
            try:
                await e.client.update_weights_from_disk(path, flush_cache=True)
                return f"{reason} (restored the old weights from {path}; version unchanged)"
            except Exception as ex:
                reason = f"{reason}; restore from {path} failed: {describe(ex)}"
        e.extra["left_paused"] = True
        return (
            f"{reason} (engine left PAUSED on partially updated weights; restart it or load a "
            "checkpoint with /update_weights_from_disk, then /continue_generation)"
        )


def take_lost(failures: dict[str, str], unreachable: set[str], version: str) -> set[str]:
    """Supervised engines that became unreachable during the sync to ``version``: taken out
    of ``failures`` (their supervisor restarts them, the driver resyncs them)."""
    lost = {u for u in unreachable if u in failures}
    for url in sorted(lost):
        log.warning(
            "%s was lost during the sync to version %s (%s); it is left to its supervisor "
            "and gets the weights once it is back", url, version, failures.pop(url),
        )  # fmt: skip
    return lost
