"""slime's samples -> train data -> one ``Box`` per DP rank, as slime's rollout manager does.

slime does this in ``slime.ray.rollout.RolloutManager`` (``_post_process_rewards``,
``_convert_samples_to_train_data``, ``_split_train_data_by_dp``). That module imports
``sglang`` at the top (and starts SGLang servers), which has no CPU build, so the three
steps are written again here, field for field (what slime's ``process_rollout_data`` and a
train actor read); the DP / micro-batch schedule itself is slime's own
``slime.utils.dp_schedule.build_dp_schedule``, and the tensors are made by slime's
``tensorize_rollout_data_for_training``.
"""

from __future__ import annotations

from typing import Any

import torch

from adapters.peers import import_peer

#: estimators whose rewards slime centres per group (and, for the GRPO family, scales)
_GROUP_NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_STD_SCALED = ("grpo", "gspo", "cispo")

#: per-sample fields handed to each DP rank (slime's list), and those handed whole
_PER_SAMPLE = (
    "tokens", "response_lengths", "rewards", "truncated", "loss_masks", "sample_indices",
    "rollout_ids", "rollout_mask_sums", "rollout_log_probs", "prompt",
)  # fmt: skip
_WHOLE = ("raw_reward", "total_lengths")


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[float], list[float]]:
    """(raw rewards, rewards the trainer uses): group-centred (and std-scaled with
    ``--grpo-std-normalization``) for the GRPO family with ``--rewards-normalization``."""
    raw = [float(s.get_reward_value(args)) for s in samples]
    if args.advantage_estimator not in _GROUP_NORMALIZED or not args.rewards_normalization:
        return raw, raw
    r = torch.tensor(raw, dtype=torch.float)
    n = args.n_samples_per_prompt
    r = r.reshape(-1, n) if r.numel() % n == 0 else r.view(1, -1)
    r = r - r.mean(dim=-1, keepdim=True)
    if args.advantage_estimator in _STD_SCALED and args.grpo_std_normalization:
        r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return raw, r.flatten().tolist()


def samples_to_train_data(args: Any, samples: list[Any]) -> dict[str, Any]:
    """slime's train data of a flat list of slime ``Sample``s."""
    status = import_peer("slime.utils.types").Sample.Status
    raw, rewards = post_process_rewards(args, samples)
    rollout_ids: list[int] = []
    taken = {s.rollout_id for s in samples if s.rollout_id is not None}
    next_id = 0
    for s in samples:  # samples without a rollout id get unused ones, one each
        if s.rollout_id is not None:
            rollout_ids.append(s.rollout_id)
            continue
        while next_id in taken:
            next_id += 1
        taken.add(next_id)
        rollout_ids.append(next_id)
    loss_masks = []
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        if len(s.loss_mask) != s.response_length:
            raise ValueError(
                f"sample {s.index}: loss_mask has {len(s.loss_mask)} entries for a response of "
                f"{s.response_length} tokens"
            )
        loss_masks.append([0] * s.response_length if s.remove_sample else s.loss_mask)
    per_rollout: dict[int, int] = {}
    for rid, m in zip(rollout_ids, loss_masks, strict=True):
        per_rollout[rid] = per_rollout.get(rid, 0) + sum(m)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "truncated": [int(s.status == status.TRUNCATED) for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": rollout_ids,
        "loss_masks": loss_masks,
        "rollout_mask_sums": [per_rollout[rid] for rid in rollout_ids],
    }
    if samples[0].rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    return data


def split_by_dp(args: Any, data: dict[str, Any], parallel_config: dict[str, int]) -> list[Any]:
    """One ``Box(ObjectRef)`` per DP rank: its samples and micro-batch schedule (slime's
    ``build_dp_schedule``), as ``slime.utils.data.process_rollout_data`` reads them."""
    import ray

    schedule = import_peer("slime.utils.dp_schedule")
    tensorize = import_peer("slime.observability.rollout_data_utils")
    misc = import_peer("slime.utils.misc")
    data["total_lengths"] = [len(t) for t in data["tokens"]]
    partitions, mb_indices, num_mbs, gbs = schedule.build_dp_schedule(
        args,
        parallel_config,
        data["total_lengths"],
        global_batch_size=args.global_batch_size,
        rollout_indices=data["rollout_ids"],
    )
    refs = []
    for rank, part in enumerate(partitions):
        shard: dict[str, Any] = {"partition": part}
        for key in _PER_SAMPLE:
            if key in data:
                shard[key] = [data[key][j] for j in part]
        for key in _WHOLE:
            if key in data:
                shard[key] = data[key]
        shard["global_batch_sizes"] = gbs
        shard["num_microbatches"] = num_mbs
        shard["micro_batch_indices"] = mb_indices[rank]
        tensorize.tensorize_rollout_data_for_training(shard)
        refs.append(misc.Box(ray.put(shard)))
    return refs
