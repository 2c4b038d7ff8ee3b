"""miles' command line, for ``python -m adapters.miles.train``.

``adapters.common.arguments`` holds the flags both drivers share (and why miles' own parser,
``miles.utils.arguments``, cannot run here); this module adds miles' own and sets every
other attribute miles' own code on this path reads (``TrainRayActor``,
``RayTrainGroup``, the object store, ``postprocess_rollout_data``,
``convert_samples_to_train_data``, ``split_train_data_by_dp``, ``build_dp_schedule``,
``compute_request_payload``, ``update_sample_from_response``) to miles' default. The model,
layout and Titan's switches come from the Titan YAML (``--titan-config`` / ``TITAN_CONFIG``,
plus ``--titan-override key=value``), as miles' Megatron arguments would; the optimizer and
algorithm flags are ``None`` unless given, so the YAML's values hold
(``adapters.common.config.ARG_TO_KEY`` maps them).

Weight transfer: miles' ``--colocate`` (tensor update) and ``--update-weight-transfer-mode``
(``broadcast`` / ``p2p`` / ``disk-delta``) choose Titan's ``sync.transport`` (``tensor`` /
``distributed`` / ``mooncake`` / ``disk``) when given; otherwise the YAML's ``sync`` holds.

A flag miles has and this parser does not is argparse's error naming it, so a miles command
line never runs with a flag silently dropped.
"""

from __future__ import annotations

import argparse
from typing import Any

from adapters.common.arguments import base_parser, finish

#: miles' transfer mode -> Titan's sync.transport
TRANSFER_MODE_TO_TRANSPORT = {"broadcast": "distributed", "p2p": "mooncake", "disk-delta": "disk"}

#: attributes miles' modules read that this driver does not expose as flags: miles' defaults
MILES_DEFAULTS: dict[str, Any] = {
    "train_backend": "megatron",
    "train_env_vars": {},
    "offload_train": False,
    "offload_rollout": False,
    "debug_rollout_only": False,
    "debug_train_only": False,
    "use_critic": False,
    "use_opd": False,
    "opd_type": None,
    "indep_dp": False,
    "use_fault_tolerance": False,
    "ft_components": [],
    "start_rollout_id": None,
    "object_store_backend": "ray",
    "delay_split_train_data_by_dp": False,
    "disable_rollout_trim_samples": False,
    "use_dynamic_global_batch_size": False,
    "use_dynamic_batch_size": False,
    "max_tokens_per_gpu": None,
    "allow_partial_train_step": False,
    "balance_data": False,
    "balance_by_flops": False,
    "multi_lora": False,
    "lora_rank": 0,
    "lora_adapter_path": None,
    "rollout_max_context_len": None,
    "rollout_skip_special_tokens": False,
    "use_rollout_routing_replay": False,
    "use_rollout_indexer_replay": False,
    "sglang_speculative_algorithm": None,
    "sglang_router_policy": None,
    "reward_key": None,
    "save_debug_event_data": None,
    "dumper_source_patcher_config_train": None,
}


def build_parser() -> argparse.ArgumentParser:
    ap, group = base_parser(
        "miles",
        actor_gpus_per_node=8,
        data_source_path="adapters.miles.data_source.TitanPromptSource",
        rollout_function_path="adapters.miles.generate.generate_rollout",
    )
    c = group["cluster"]
    c.add_argument("--rollout-external", action="store_true", default=False)
    c.add_argument("--rollout-external-engine-addrs", type=str, nargs="+", default=None)
    d = group["rollout"]
    d.add_argument("--custom-reward-post-process-path", default=None)
    d.add_argument("--custom-convert-samples-to-train-data-path", default=None)
    k = group["checkpoints"]
    k.add_argument("--save-hf", default=None,
                   help="HF export at each save, a path with {rollout_id} (miles' --save-hf)")  # fmt: skip
    k.add_argument("--update-weight-transfer-mode", default=None,
                   choices=sorted(TRANSFER_MODE_TO_TRANSPORT),
                   help="miles' non-colocated transfer; sets Titan's sync.transport "
                        "(default: the Titan YAML's)")  # fmt: skip
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """miles' args namespace: the flags above, miles' defaults for the rest, and the checks
    miles' parser makes on them (each error names the flag)."""
    ap = build_parser()
    args = finish(ap, ap.parse_args(argv), MILES_DEFAULTS)
    if args.rollout_external and not args.rollout_external_engine_addrs:
        ap.error("--rollout-external needs --rollout-external-engine-addrs host:port ...")
    mode = args.update_weight_transfer_mode
    if args.colocate and mode is not None:
        ap.error("--update-weight-transfer-mode is for non-colocated engines; drop --colocate")
    transport = "tensor" if args.colocate else TRANSFER_MODE_TO_TRANSPORT.get(mode or "")
    if transport is not None:
        args.titan_overrides = [*args.titan_overrides, f"sync.transport={transport}"]
        if transport == "disk":
            if not args.update_weight_disk_dir:
                ap.error("--update-weight-transfer-mode disk-delta needs --update-weight-disk-dir")
            args.titan_overrides.append(f"sync.disk.dir={args.update_weight_disk_dir}")
    return args
