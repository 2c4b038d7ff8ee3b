"""Rows into microbatches with as little padding as exactness allows.

A batch is right-padded to its longest row. Every loss term is a sum over trained tokens
divided by a count taken over the whole batch, and a causal model's output at a position
does not depend on the tokens after it, so neither the grouping of rows into microbatches nor
the padding after a row's last trained token changes the result (beyond the order of float
additions). :func:`plan_microbatches` therefore sorts the rows by the length they need and
cuts each microbatch to its own longest row: a long-tailed batch (a few long responses, as
partial rollouts and the tail of a generation produce) is no longer computed at the length
of its longest row throughout.

Pipeline parallelism sends activations of one fixed shape between stages, so with more than
one stage every microbatch keeps the batch's full length (``trim=False``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def needed_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens the model must see: through the label of its last trained
    position (position t scores token t + 1); 1 for a row with nothing trained."""
    positions = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    last = ((response_mask != 0) * positions).amax(dim=1)
    return (last + 1).clamp(min=1).cpu()


@dataclass(frozen=True)
class MicrobatchPlan:
    """Microbatches of ``size`` rows: rows ``order[i * size:(i + 1) * size]`` (``order``
    None: in the batch's order) cut to ``widths[i]`` tokens of the batch's ``width``."""

    size: int
    width: int
    widths: tuple[int, ...]
    order: torch.Tensor | None

    @property
    def num(self) -> int:
        return len(self.widths)

    def rows(self, i: int) -> slice | torch.Tensor:
        lo, hi = i * self.size, (i + 1) * self.size
        return slice(lo, hi) if self.order is None else self.order[lo:hi]

    def batches(
        self, fields: dict[str, torch.Tensor], device: torch.device
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Each microbatch's fields on ``device``: fields as long as the tokens ([B, L, ...])
        cut to the microbatch's width, per-token fields ([B, L - 1]) to one less."""
        for i in range(self.num):
            rows, w = self.rows(i), self.widths[i]
            mb = {}
            for key, value in fields.items():
                value = value[rows]
                if value.dim() > 1 and value.shape[1] == self.width:
                    value = value[:, :w]
                elif value.dim() > 1 and value.shape[1] == self.width - 1:
                    value = value[:, : w - 1]
                mb[key] = value.to(device)
            yield mb

    def restore(self, per_row: torch.Tensor) -> torch.Tensor:
        """Outputs concatenated in microbatch order ([num * size, ...]) back in the batch's
        row order."""
        if self.order is None:
            return per_row
        out = torch.empty_like(per_row)
        out[self.order[: self.num * self.size]] = per_row
        return out


def plan_microbatches(
    lengths: torch.Tensor, size: int, width: int, multiple: int = 8, trim: bool = True
) -> MicrobatchPlan:
    """The microbatches of a batch of ``len(lengths)`` rows padded to ``width`` tokens,
    ``size`` rows each; with ``trim`` the rows sorted longest first and each microbatch cut
    to its longest row's needed length rounded up to ``multiple`` (at most ``width``)."""
    n = int(lengths.shape[0])
    num = max(1, n // size)
    if not trim:
        return MicrobatchPlan(size, width, (width,) * num, None)
    order = torch.argsort(lengths, descending=True, stable=True)
    widths = []
    for i in range(num):
        longest = int(lengths[order[i * size : (i + 1) * size]].max())
        widths.append(min(width, math.ceil(longest / multiple) * multiple))
    return MicrobatchPlan(size, width, tuple(widths), order)


__all__ = ["MicrobatchPlan", "needed_lengths", "plan_microbatches"]
