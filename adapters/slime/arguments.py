"""slime's command line, for ``python -m adapters.slime.train`` (``adapters.common.arguments``
holds the flags both drivers share and why slime's own parser cannot run here); every
other attribute slime's own code reads (``RayTrainGroup``, ``create_placement_groups``,
``build_dp_schedule``, ``process_rollout_data``) gets slime's default."""

from __future__ import annotations

import argparse
from typing import Any

from adapters.common.arguments import base_parser, finish

#: attributes slime's modules read that this driver does not expose as flags: slime's defaults
SLIME_DEFAULTS: dict[str, Any] = {
    "train_backend": "megatron",
    "train_env_vars": {},
    "offload_train": False,
    "offload_rollout": False,
    "release_train": False,
    "use_routing_replay": False,
    "use_rollout_routing_replay": False,
    "rollout_data_transport": "object-store",
    "debug_rollout_only": False,
    "debug_train_only": False,
    "rollout_external": False,
    "use_critic": False,
    "use_opd": False,
    "opd_type": None,
    "megatron_config_path": None,
    "start_rollout_id": None,
    "use_dynamic_batch_size": False,
    "max_tokens_per_gpu": None,
    "balance_data": False,
    "balance_by_flops": False,
    "check_weight_update_equal": False,
    "update_weight_disk_keep_files": False,
    "update_weight_local_checkpoint_dir": None,
    "ci_test": False,
    "reward_key": None,
    "remove_sample": False,
    "num_epoch": None,
    "rollout_max_prompt_len": None,
    "multimodal_keys": None,
    "tool_key": None,
    "apply_chat_template": False,
    "apply_chat_template_kwargs": None,
    "dump_details": None,
}


def build_parser() -> argparse.ArgumentParser:
    ap, group = base_parser(
        "slime",
        actor_gpus_per_node=1,
        data_source_path="adapters.slime.data_source.TitanPromptSource",
        rollout_function_path="adapters.slime.rollout.generate_rollout",
    )
    d = group["rollout"]
    d.add_argument("--prompt-data", default=None)
    d.add_argument("--input-key", default="input")
    d.add_argument("--label-key", default=None)
    d.add_argument("--metadata-key", default="metadata")
    d.add_argument("--rollout-shuffle", action="store_true", default=False)
    d.add_argument("--custom-generate-function-path", default=None)
    d.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    k = group["checkpoints"]
    k.add_argument("--update-weight-mode", default="full", choices=["full"])
    k.add_argument("--update-weight-transport", default="nccl", choices=["nccl", "disk"])
    k.add_argument("--update-weight-start-version", type=int, default=0)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """slime's args namespace: the flags above, slime's defaults for the rest, and the
    checks slime's parser makes on them (each error names the flag)."""
    ap = build_parser()
    args = finish(ap, ap.parse_args(argv), SLIME_DEFAULTS)
    if args.update_weight_transport == "disk" and not args.update_weight_disk_dir:
        ap.error("--update-weight-transport disk needs --update-weight-disk-dir")
    return args
