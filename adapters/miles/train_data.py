"""A miles DP rank's share of a rollout, read as miles' Megatron actor reads it.

miles' train actors get their rows from ``miles.utils.data.process_rollout_data``. That
module cannot be imported without ``sglang``: it imports ``miles.utils.chat_template_utils``
at the top (for its prompt ``Dataset``), whose template module imports sglang's parsers.
The function itself only calls miles' object store and two functions of
``miles.ray.rollout.train_data_conversion``, which import on a CPU machine, so
:func:`rank_rollout_data` calls those same three (``object_store.get_instance().get``,
``split_train_data_by_dp_raw``, ``process_rollout_data_shard``) in the same order.

:func:`with_step_schedule` fills in the per-step micro-batch schedule when miles' rollout
side did not compute it (``--delay-split-train-data-by-dp``, or a layout without
``train_parallel_config``), as miles' Megatron data iterator would: ``--global-batch-size``
samples per optimizer step, split evenly over DP ranks, in micro-batches of
``--micro-batch-size``.
"""

from __future__ import annotations

from typing import Any

from adapters.common.rollout_data import RolloutDataError
from adapters.peers import import_peer

_object_store = import_peer("miles.utils.object_store")
_conversion = import_peer("miles.ray.rollout.train_data_conversion")


def rank_rollout_data(
    args: Any, rollout_data_ref: Any, dp_rank: int, dp_size: int, witness_info: Any = None
) -> tuple[dict[str, Any], Any]:
    """(this rank's rollout data, miles' ``ObjectStoreGetResult`` to release after training).

    ``rollout_data_ref``: one store ref per DP rank (miles' ``split_train_data_by_dp``), or
    with ``--delay-split-train-data-by-dp`` one ref of the whole rollout, split here with
    miles' ``split_train_data_by_dp_raw`` (witness ids attached first, as miles does).
    """
    store = _object_store.get_instance()
    if getattr(args, "delay_split_train_data_by_dp", False):
        got = store.get(rollout_data_ref)
        whole = dict(got.value)
        if witness_info is not None:
            whole["seq_witness_ids"] = witness_info.witness_ids
        shard = _conversion.split_train_data_by_dp_raw(args, whole, dp_size=dp_size)[dp_rank]
    else:
        if witness_info is not None:
            raise RolloutDataError(
                "witness ids come with --delay-split-train-data-by-dp only (miles' rule)"
            )
        if len(rollout_data_ref) != dp_size:
            raise RolloutDataError(
                f"the rollout was split for {len(rollout_data_ref)} DP ranks, the trainer has "
                f"{dp_size}: the rollout manager's train_parallel_config is stale"
            )
        got = store.get(rollout_data_ref[dp_rank])
        shard = dict(got.value)
    return _conversion.process_rollout_data_shard(args, shard), got


def with_step_schedule(args: Any, data: dict[str, Any], dp_size: int) -> dict[str, Any]:
    """``data`` with ``num_microbatches`` / ``micro_batch_indices`` (miles' schedule keys);
    unchanged when the rollout side scheduled it."""
    if "num_microbatches" in data and "micro_batch_indices" in data:
        return data
    gbs = int(data.get("dynamic_global_batch_size") or args.global_batch_size)
    if gbs % dp_size:
        raise RolloutDataError(
            f"--global-batch-size {gbs} is not divisible by the {dp_size} DP ranks"
        )
    per_step = gbs // dp_size
    mbs = int(args.micro_batch_size)
    n = len(data["tokens"])
    steps = n // per_step
    if steps == 0:
        raise RolloutDataError(
            f"this DP rank has {n} samples, fewer than one optimizer step's {per_step} "
            f"(--global-batch-size {gbs} over {dp_size} ranks)"
        )
    micro: list[list[int]] = []
    counts: list[int] = []
    for s in range(steps):
        lo, hi = s * per_step, (s + 1) * per_step
        chunks = [list(range(i, min(i + mbs, hi))) for i in range(lo, hi, mbs)]
        micro += chunks
        counts.append(len(chunks))
    return {**data, "num_microbatches": counts, "micro_batch_indices": micro}
