"""slime's command line, for ``python -m adapters.slime.train``.

slime's own parser (``slime.utils.arguments.parse_args``) cannot run on a CPU machine: it
imports ``sglang.srt.server_args`` (whose utils import ``triton``, ~1 GB, at module level)
and always imports ``megatron.training``, which is in Megatron-LM's source tree but not in
the megatron-core wheel. So this module declares the slime flags the Titan backend and the
driver use, with slime's names, meanings and defaults, and fills every other attribute
slime's own code reads (``RayTrainGroup``, ``create_placement_groups``,
``build_dp_schedule``, ``process_rollout_data``) with slime's default. The model, layout
and Titan's switches come from the Titan YAML (``--titan-config`` / ``TITAN_CONFIG``), as
slime's Megatron arguments would; the optimizer flags below are ``None`` unless given, so
the Titan YAML's values hold (``adapters.common.config.ARG_TO_KEY`` maps them).

A flag slime has and this parser does not is an error naming it (argparse's own), so a
slime command line never runs with a flag silently dropped.
"""

from __future__ import annotations

import argparse
from typing import Any

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
    ap = argparse.ArgumentParser(
        prog="python -m adapters.slime.train",
        description="slime's RL loop with Titan's Megatron base as the training backend",
        allow_abbrev=False,
    )
    t = ap.add_argument_group("Titan")
    t.add_argument("--titan-config", default=None,
                   help="Titan YAML (titan_rl.grpo's format): model, layout, switches, sync; "
                        "default $TITAN_CONFIG")  # fmt: skip
    t.add_argument(
        "--titan-override",
        dest="titan_overrides",
        nargs="+",
        action="extend",
        default=[],
        metavar="KEY=VALUE",
        help="Titan config overrides (key.sub=value), e.g. sync.check_every=1",
    )
    t.add_argument(
        "--metrics-dir",
        default=None,
        help="where metrics.jsonl and reward.png go (default: the Titan run.dir)",
    )

    c = ap.add_argument_group("cluster (slime's names)")
    c.add_argument("--actor-num-nodes", type=int, default=1)
    c.add_argument("--actor-num-gpus-per-node", type=int, default=1)
    c.add_argument("--rollout-num-gpus", type=int, default=None)
    c.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    c.add_argument("--num-gpus-per-node", type=int, default=8)
    c.add_argument("--colocate", action="store_true", default=False)

    d = ap.add_argument_group("data and rollout (slime's names)")
    d.add_argument(
        "--hf-checkpoint",
        default=None,
        help="HF directory the engines start from (default: the Titan policy, exported)",
    )
    d.add_argument("--data-source-path", default="adapters.slime.data_source.TitanPromptSource")
    d.add_argument("--prompt-data", default=None)
    d.add_argument("--input-key", default="input")
    d.add_argument("--label-key", default=None)
    d.add_argument("--metadata-key", default="metadata")
    d.add_argument("--disable-rollout-global-dataset", action="store_false",
                   dest="rollout_global_dataset", default=True)  # fmt: skip
    d.add_argument("--rollout-shuffle", action="store_true", default=False)
    d.add_argument("--rollout-seed", type=int, default=42)
    d.add_argument("--num-rollout", type=int, required=True)
    d.add_argument("--rollout-batch-size", type=int, required=True)
    d.add_argument("--n-samples-per-prompt", type=int, default=1)
    d.add_argument("--rollout-max-response-len", type=int, default=None)
    d.add_argument("--rollout-temperature", type=float, default=1.0)
    d.add_argument("--rollout-top-p", type=float, default=1.0)
    d.add_argument("--rollout-top-k", type=int, default=-1)
    d.add_argument("--rollout-stop", type=str, nargs="+", default=None)
    d.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None)
    d.add_argument("--rollout-function-path", default="adapters.slime.rollout.generate_rollout")
    d.add_argument("--eval-function-path", default=None)
    d.add_argument("--custom-generate-function-path", default=None)
    d.add_argument("--custom-rm-path", default=None)
    d.add_argument("--group-rm", action="store_true", default=False)
    d.add_argument("--eval-interval", type=int, default=None)
    d.add_argument("--n-samples-per-eval-prompt", type=int, default=1)
    d.add_argument("--eval-temperature", type=float, default=None)
    d.add_argument("--eval-max-response-len", type=int, default=None)

    a = ap.add_argument_group("algorithm (slime's names; unset: the Titan YAML's value)")
    a.add_argument("--advantage-estimator", default="grpo",
                   choices=["grpo", "gspo", "cispo", "reinforce_plus_plus",
                            "reinforce_plus_plus_baseline", "ppo"])  # fmt: skip
    a.add_argument("--disable-rewards-normalization", action="store_false",
                   dest="rewards_normalization", default=True)  # fmt: skip
    a.add_argument("--disable-grpo-std-normalization", action="store_false",
                   dest="grpo_std_normalization", default=True)  # fmt: skip
    a.add_argument("--eps-clip", type=float, default=None)
    a.add_argument("--eps-clip-high", type=float, default=None)
    a.add_argument("--eps-clip-c", type=float, default=None)
    a.add_argument("--use-kl-loss", action="store_true", default=None)
    a.add_argument("--kl-loss-coef", type=float, default=None)
    a.add_argument("--kl-loss-type", default=None, choices=["k1", "k2", "k3", "low_var_kl"])
    a.add_argument("--kl-coef", type=float, default=0.0)
    a.add_argument("--entropy-coef", type=float, default=None)
    a.add_argument("--use-tis", action="store_true", default=False)

    o = ap.add_argument_group("training (slime's / Megatron's names; unset: the Titan YAML's)")
    o.add_argument("--lr", type=float, default=None)
    o.add_argument("--min-lr", type=float, default=None)
    o.add_argument("--weight-decay", type=float, default=None)
    o.add_argument("--clip-grad", type=float, default=None)
    o.add_argument("--micro-batch-size", type=int, default=None)
    o.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help="samples per optimizer step (default: the whole rollout, one step)",
    )
    o.add_argument("--seed", type=int, default=None)
    o.add_argument("--tensor-model-parallel-size", type=int, default=None)
    o.add_argument("--pipeline-model-parallel-size", type=int, default=None)
    o.add_argument("--context-parallel-size", type=int, default=None)
    o.add_argument("--expert-model-parallel-size", type=int, default=None)
    o.add_argument("--distributed-backend", default="nccl")
    o.add_argument("--distributed-timeout-minutes", type=int, default=10)

    k = ap.add_argument_group("checkpoints and weight updates (slime's names)")
    k.add_argument("--load", default=None, help="a Titan checkpoint folder to start from")
    k.add_argument("--save", default=None, help="where checkpoints go (and resume from)")
    k.add_argument("--save-interval", type=int, default=None)
    k.add_argument("--update-weight-mode", default="full", choices=["full"])
    k.add_argument("--update-weight-transport", default="nccl", choices=["nccl", "disk"])
    k.add_argument("--update-weight-disk-dir", default=None)
    k.add_argument("--update-weight-start-version", type=int, default=0)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """slime's args namespace: the flags above, slime's defaults for the rest, and the
    checks slime's parser makes on them (each error names the flag)."""
    ap = build_parser()
    args = ap.parse_args(argv)
    for key, value in SLIME_DEFAULTS.items():
        if not hasattr(args, key):
            setattr(args, key, value)
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        ap.error("--rollout-num-gpus must be a multiple of --rollout-num-gpus-per-engine")
    per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if args.global_batch_size is None:
        args.global_batch_size = per_rollout
    if per_rollout % args.global_batch_size:
        ap.error(
            f"--global-batch-size {args.global_batch_size} must divide --rollout-batch-size x "
            f"--n-samples-per-prompt ({per_rollout})"
        )
    if args.update_weight_transport == "disk" and not args.update_weight_disk_dir:
        ap.error("--update-weight-transport disk needs --update-weight-disk-dir")
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    return args
