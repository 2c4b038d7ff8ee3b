"""slime's samples -> train data -> one ``Box`` per DP rank, as slime's rollout manager does.

slime does this in ``slime.ray.rollout.RolloutManager`` (``_post_process_rewards``,
``_convert_samples_to_train_data``, ``_split_train_data_by_dp``). That module imports
``sglang`` at the top (and starts SGLang servers), which has no CPU build, so the three
steps are written again here, key for key and value for value (the test runs slime's own
methods, read from the installed wheel, on the same samples and compares). What those
methods call is slime's own: ``load_function`` for ``--custom-reward-post-process-path`` and
``--custom-convert-samples-to-train-data-path``, ``Sample.get_reward_value``,
``slime.utils.data.get_source``, ``validate_rollout_routed_experts_for_replay``,
``build_dp_schedule``, ``tensorize_rollout_data_for_training`` and ``Box``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from adapters.peers import import_peer

#: estimators whose rewards slime centres (per group, or over the batch), and those it scales
_GROUP_NORMALIZED = ("grpo", "gspo", "cispo", "reinforce_plus_plus_baseline")
_STD_SCALED = ("grpo", "gspo", "cispo")

#: per-sample fields handed to each DP rank (slime's list, in slime's order), and those
#: handed whole (split on the train side)
_PER_SAMPLE = (
    "tokens", "multimodal_train_inputs", "response_lengths", "rewards", "truncated",
    "loss_masks", "round_number", "sample_indices", "rollout_ids", "rollout_mask_sums",
    "rollout_log_probs", "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
    "rollout_routed_experts", "source_names", "prompt", "teacher_log_probs",
)  # fmt: skip
_WHOLE = ("raw_reward", "total_lengths")


def _hook(args: Any, attr: str) -> Callable[..., Any] | None:
    """The function ``args.<attr>`` names (slime's ``load_function``), or None if unset."""
    path = getattr(args, attr, None)
    if path is None:
        return None
    return import_peer("slime.utils.misc").load_function(path)


def post_process_rewards(args: Any, samples: list[Any]) -> tuple[list[Any], list[Any]]:
    """(raw rewards, rewards the trainer uses), as slime's ``_post_process_rewards``.

    ``--custom-reward-post-process-path`` replaces it (``f(args, samples)``). Otherwise, for
    the GRPO family and ``reinforce_plus_plus_baseline`` with ``--rewards-normalization``,
    rewards are centred (and, for the GRPO family with ``--grpo-std-normalization``, divided
    by ``std + 1e-6``) per group of ``--n-samples-per-prompt`` when the batch holds exactly
    ``rollout_batch_size x n_samples_per_prompt`` samples, and over the whole batch when it
    does not. Raw rewards are ``Sample.get_reward_value(args)`` (``--reward-key``), as given.
    """
    custom = _hook(args, "custom_reward_post_process_path")
    if custom is not None:
        return custom(args, samples)
    raw = [s.get_reward_value(args) for s in samples]
    if args.advantage_estimator not in _GROUP_NORMALIZED or not args.rewards_normalization:
        return raw, raw
    r = torch.tensor(raw, dtype=torch.float)
    n = args.n_samples_per_prompt
    # a full batch per group; otherwise (groups of unequal size) one group, the whole batch
    r = r.view(-1, n) if r.numel() == n * args.rollout_batch_size else r.view(1, -1)
    r = r - r.mean(dim=-1, keepdim=True)
    if args.advantage_estimator in _STD_SCALED and args.grpo_std_normalization:
        r = r / (r.std(dim=-1, keepdim=True) + 1e-6)
    return raw, r.flatten().tolist()


def _rollout_ids(samples: list[Any]) -> list[int]:
    """Each sample's ``rollout_id``; samples without one get unused ids, one each, in order."""
    ids: list[int] = []
    taken = {s.rollout_id for s in samples if s.rollout_id is not None}
    next_id = 0
    for s in samples:
        if s.rollout_id is not None:
            ids.append(s.rollout_id)
            continue
        while next_id in taken:
            next_id += 1
        taken.add(next_id)
        ids.append(next_id)
    return ids


def _loss_masks(samples: list[Any]) -> list[list[int]]:
    """Each sample's loss mask, set on the sample as slime does: all ones when it has none,
    all zeros for a ``remove_sample``."""
    masks = []
    for s in samples:
        if s.loss_mask is None:
            s.loss_mask = [1] * s.response_length
        if len(s.loss_mask) != s.response_length:
            raise ValueError(
                f"sample {s.index}: loss_mask has {len(s.loss_mask)} entries for a response of "
                f"{s.response_length} tokens"
            )
        if s.remove_sample:
            s.loss_mask = [0] * s.response_length
        masks.append(s.loss_mask)
    return masks


def _check_top_p(samples: list[Any]) -> None:
    """With ``--rollout-top-p`` below 1 every sample carries its nucleus token ids and
    ``response_length + 1`` offsets into them (slime's checks)."""
    for s in samples:
        ids, offsets = s.rollout_top_p_token_ids, s.rollout_top_p_token_offsets
        if ids is None or offsets is None:
            raise ValueError(
                f"sample {s.index}: --rollout-top-p < 1 needs rollout_top_p_token_ids and "
                "rollout_top_p_token_offsets"
            )
        if len(offsets) != s.response_length + 1:
            raise ValueError(
                f"sample {s.index}: top-p token offsets length {len(offsets)} != response "
                f"length + 1 {s.response_length + 1}"
            )
        if int(offsets[-1]) != len(ids):
            raise ValueError(
                f"sample {s.index}: top-p token offsets[-1] {int(offsets[-1])} != token ids "
                f"length {len(ids)}"
            )


def samples_to_train_data(args: Any, samples: list[Any]) -> dict[str, Any]:
    """slime's train data of a flat list of slime ``Sample``s (``_convert_samples_to_train_data``).

    ``--custom-convert-samples-to-train-data-path`` replaces it (``f(args, samples)``).
    Always: ``tokens``, ``response_lengths``, ``rewards``, ``raw_reward``, ``truncated``,
    ``sample_indices``, ``rollout_ids``, ``loss_masks``, ``rollout_mask_sums``; as the first
    sample (or, for ``raw_reward`` / multimodal, any sample) has them: ``round_number``,
    ``rollout_log_probs``, ``rollout_top_p_token_*`` (``--rollout-top-p`` < 1),
    ``rollout_routed_experts`` (checked for replay with ``--use-rollout-routing-replay``),
    ``metadata`` (``train_metadata``), ``multimodal_train_inputs``, ``teacher_log_probs``,
    ``source_names``.
    """
    custom = _hook(args, "custom_convert_samples_to_train_data_path")
    if custom is not None:
        return custom(args, samples)
    truncated = import_peer("slime.utils.types").Sample.Status.TRUNCATED
    raw, rewards = post_process_rewards(args, samples)
    if len(raw) != len(samples) or len(rewards) != len(samples):
        raise ValueError(
            f"reward post-processing returned {len(raw)} raw rewards and {len(rewards)} "
            f"rewards for {len(samples)} samples"
        )
    rollout_ids = _rollout_ids(samples)
    data: dict[str, Any] = {
        "tokens": [s.tokens for s in samples],
        "response_lengths": [s.response_length for s in samples],
        "rewards": rewards,
        "raw_reward": raw,
        "truncated": [1 if s.status == truncated else 0 for s in samples],
        "sample_indices": [s.index for s in samples],
        "rollout_ids": rollout_ids,
    }
    loss_masks = _loss_masks(samples)
    data["loss_masks"] = loss_masks
    # each sample carries its whole rollout's trained-token count (the loss denominator)
    per_rollout: dict[int, int] = {}
    for rid, m in zip(rollout_ids, loss_masks, strict=True):
        per_rollout[rid] = per_rollout.get(rid, 0) + sum(m)
    data["rollout_mask_sums"] = [per_rollout[rid] for rid in rollout_ids]

    first = samples[0]
    if any(s.metadata and "raw_reward" in s.metadata for s in samples):
        data["raw_reward"] = [
            s.metadata["raw_reward"] if s.metadata and "raw_reward" in s.metadata else s.reward
            for s in samples
        ]
    if first.metadata and "round_number" in first.metadata:
        data["round_number"] = [s.metadata["round_number"] for s in samples]
    if first.rollout_log_probs is not None:
        data["rollout_log_probs"] = [s.rollout_log_probs for s in samples]
    if getattr(args, "rollout_top_p", 1.0) != 1.0:
        _check_top_p(samples)
        data["rollout_top_p_token_ids"] = [s.rollout_top_p_token_ids for s in samples]
        data["rollout_top_p_token_offsets"] = [s.rollout_top_p_token_offsets for s in samples]
    if first.rollout_routed_experts is not None:
        experts = [torch.as_tensor(s.rollout_routed_experts) for s in samples]
        if getattr(args, "use_rollout_routing_replay", False):
            checks = import_peer("slime.observability.rollout_data_utils")
            checks.validate_rollout_routed_experts_for_replay(experts, args)
        data["rollout_routed_experts"] = experts
    if first.train_metadata is not None:
        data["metadata"] = [s.train_metadata for s in samples]
    if any(s.multimodal_train_inputs is not None for s in samples):
        data["multimodal_train_inputs"] = [s.multimodal_train_inputs for s in samples]
    if first.teacher_log_probs is not None:
        data["teacher_log_probs"] = [s.teacher_log_probs for s in samples]
    if first.metadata is not None:
        get_source = import_peer("slime.utils.data").get_source
        data["source_names"] = [get_source(s) for s in samples]
    return data


def split_by_dp(args: Any, data: dict[str, Any], parallel_config: dict[str, int]) -> list[Any]:
    """One ``Box(ObjectRef)`` per DP rank: its samples and micro-batch schedule (slime's
    ``build_dp_schedule``), as ``slime.utils.data.process_rollout_data`` reads them; put in
    Ray's object store, or sent over NIXL with ``--rollout-data-transport nixl``."""
    import ray

    schedule = import_peer("slime.utils.dp_schedule")
    tensorize = import_peer("slime.observability.rollout_data_utils")
    misc = import_peer("slime.utils.misc")
    transport = getattr(args, "rollout_data_transport", "object-store")
    if transport not in ("object-store", "nixl"):
        raise ValueError(f"Unsupported rollout data transport: {transport!r}")
    data["total_lengths"] = [len(t) for t in data["tokens"]]
    partitions, mb_indices, num_mbs, gbs = schedule.build_dp_schedule(
        args,
        parallel_config,
        data["total_lengths"],
        global_batch_size=args.global_batch_size,
        rollout_indices=data["rollout_ids"],
    )
    refs = []
    for rank in range(parallel_config["dp_size"]):
        part = partitions[rank]
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
        if transport == "nixl":
            refs.append(misc.Box(ray.put(shard, _tensor_transport="nixl")))
        else:
            refs.append(misc.Box(ray.put(shard)))
    return refs
