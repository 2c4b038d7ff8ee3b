"""Where a weight update's full tensors come from on each TP rank of the built-in engine."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FromTensor:
    """``/update_weights_from_tensor``: ``payloads[k]`` is engine TP rank k's entry."""

    payloads: list[str]
    load_format: str | None

    def for_rank(self, rank: int) -> FromTensor:
        return FromTensor([self.payloads[rank]], self.load_format)


@dataclass(frozen=True)
class FromDisk:
    """``/update_weights_from_disk``: every rank reads the safetensors itself."""

    path: str

    def for_rank(self, rank: int) -> FromDisk:
        return self


@dataclass(frozen=True)
class FromGroup:
    """``/update_weights_from_distributed``: every rank receives the trainer's broadcast."""

    group_name: str
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    load_format: str | None

    def for_rank(self, rank: int) -> FromGroup:
        return self


Source = FromTensor | FromDisk | FromGroup


__all__ = ["FromDisk", "FromGroup", "FromTensor", "Source"]
