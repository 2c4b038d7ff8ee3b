"""A slime / miles DP rank's rollout data -> Titan ``RLBatch``es, one per optimizer step.

slime's rollout manager turns ``Sample``s into train data (``tokens``, ``response_lengths``,
``loss_masks``, ``rewards`` normalized per group, ``rollout_log_probs``) and splits it over
DP ranks and optimizer steps (``num_microbatches`` per step, ``micro_batch_indices``: the
rank's micro-batches, step after step); ``slime.utils.data.process_rollout_data`` hands a
rank its share. This module keeps that split: each step's samples become one batch, padded
to whole micro-batches with rows that train no token, so every DP rank runs the same
number of micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from titan_rl.trainer.batch import RLBatch


class RolloutDataError(ValueError):
    """Rollout data that cannot be trained on; the message names the field."""


def _as_list(x: Any) -> list:
    if torch.is_tensor(x):
        return x.tolist()
    return list(x)


def step_indices(rollout_data: dict[str, Any]) -> list[list[int]]:
    """The rank-local sample indices of each optimizer step (one step: all of them)."""
    n = len(rollout_data["tokens"])
    counts = rollout_data.get("num_microbatches")
    mbs = rollout_data.get("micro_batch_indices")
    if counts is None or mbs is None:
        return [list(range(n))]
    steps, k = [], 0
    for c in counts:
        steps.append([int(i) for mb in mbs[k : k + int(c)] for i in mb])
        k += int(c)
    if k != len(mbs):
        raise RolloutDataError(
            f"num_microbatches sums to {k} but the rank has {len(mbs)} micro_batch_indices"
        )
    return [s for s in steps if s]


def _check_lengths(data: dict[str, Any], n: int) -> None:
    for key in ("response_lengths", "rewards", "loss_masks", "rollout_log_probs"):
        if key in data and data[key] is not None and len(data[key]) != n:
            raise RolloutDataError(f"rollout data {key!r} has {len(data[key])} rows, tokens {n}")


def pack_rows(
    data: dict[str, Any],
    index: Sequence[int],
    pad_id: int,
    *,
    micro_batch_size: int = 1,
    pad_to_multiple: int = 8,
) -> RLBatch:
    """The samples ``index`` of ``data`` as one batch (advantage = the sample's reward on
    each trained token), padded with empty rows to whole micro-batches."""
    tokens = data["tokens"]
    _check_lengths(data, len(tokens))
    seqs = [_as_list(tokens[i]) for i in index]
    rows = -(-len(seqs) // micro_batch_size) * micro_batch_size
    length = max(len(s) for s in seqs)
    length = -(-length // pad_to_multiple) * pad_to_multiple
    out_tokens = torch.full((rows, length), pad_id, dtype=torch.long)
    mask = torch.zeros(rows, length - 1)
    rollout_lp = torch.zeros(rows, length - 1)
    adv = torch.zeros(rows)
    masks = data.get("loss_masks")
    lps = data.get("rollout_log_probs")
    for row, (i, seq) in enumerate(zip(index, seqs, strict=True)):
        r = int(data["response_lengths"][i])
        p = len(seq) - r
        if r <= 0 or p < 1:
            raise RolloutDataError(
                f"sample {i}: response_length {r} with {len(seq)} tokens; a sample needs at "
                "least one prompt token and one response token"
            )
        out_tokens[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        m = (
            torch.ones(r)
            if masks is None
            else torch.as_tensor(_as_list(masks[i]), dtype=torch.float)
        )
        if m.numel() != r:
            raise RolloutDataError(f"sample {i}: loss_mask has {m.numel()} entries, response {r}")
        mask[row, p - 1 : p - 1 + r] = m
        if lps is not None and lps[i] is not None and len(lps[i]) == r:
            rollout_lp[row, p - 1 : p - 1 + r] = torch.as_tensor(
                _as_list(lps[i]), dtype=torch.float
            )
        adv[row] = float(data["rewards"][i])
    return RLBatch(out_tokens, mask, rollout_lp, adv.clone(), advantages=adv)


def step_batches(rollout_data: dict[str, Any], pad_id: int, micro_batch_size: int) -> list[RLBatch]:
    """One batch per optimizer step of this DP rank's rollout data."""
    if not rollout_data.get("tokens"):
        raise RolloutDataError("rollout data has no samples ('tokens' is empty)")
    return [
        pack_rows(rollout_data, idx, pad_id, micro_batch_size=micro_batch_size)
        for idx in step_indices(rollout_data)
    ]
