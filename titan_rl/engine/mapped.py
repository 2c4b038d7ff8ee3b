"""The storages of ``/update_weights_from_tensor`` payloads the engine keeps mapped."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from titan_rl.engine.core import Engine


class MappedStorages:
    """The storages of recent ``/update_weights_from_tensor`` payloads, kept referenced.

    A sender that reuses its shared memory (titan_rl.sync's staging buffers, or with
    ``tensor_format=direct`` its parameters themselves) is then mapped once, not on every
    update: torch's ``rebuild_storage_filename`` finds the live storage in its cache, where
    mapping a segment anew costs page faults (~3 ms per MiB under a sandboxed kernel). A direct
    sync spans one storage per parameter and several requests, so the storages of the current
    weight version's updates and of the previous version's are kept: the next sync finds all
    it sends. Bounded: a version holds each storage once, and once its storages exceed
    ``max_bytes`` (a sender that never bumps the version) it counts as a new version.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.current: dict[int, torch.UntypedStorage] = {}
        self.previous: dict[int, torch.UntypedStorage] = {}
        self.current_bytes = 0

    def add(self, named: list[tuple[str, torch.Tensor]]) -> None:
        for _, t in named:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.current:
                continue
            if self.current_bytes + storage.nbytes() > self.max_bytes:
                self.new_version()
            self.current[key] = storage
            self.current_bytes += storage.nbytes()

    def new_version(self) -> None:
        """The updates so far make a version: keep them (as the previous one) until the next."""
        if self.current:
            self.previous, self.current, self.current_bytes = self.current, {}, 0

    def clear(self) -> None:
        self.current, self.previous, self.current_bytes = {}, {}, 0

    def __len__(self) -> int:
        return len(self.current.keys() | self.previous.keys())


def mapped_limit(engine: Engine) -> int:
    """The bound of :class:`MappedStorages` per version: a sync's storages are the weights
    (sent by reference, with some staging) or a sender's staging buffers (two buckets)."""
    model = getattr(engine, "model", None)
    n = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    return n + n // 2 + (1 << 30)
