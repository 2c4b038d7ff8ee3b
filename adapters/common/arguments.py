"""The command line slime's and miles' drivers share: their frameworks' flag names,
meanings and defaults for what the Titan backend and the drivers use.

Their own parsers (``slime.utils.arguments``, ``miles.utils.arguments``) cannot run on a CPU
machine: they import ``sglang``'s server arguments (whose utils import ``triton``, ~1 GB, at
module level) and always import ``megatron.training``, which is in Megatron-LM's source tree
but not in the megatron-core wheel. The model, layout and Titan's switches come from the
Titan YAML (``--titan-config`` / ``TITAN_CONFIG``, plus ``--titan-override key=value``), as
the frameworks' Megatron arguments would; the optimizer and algorithm flags are ``None``
unless given, so the YAML's values hold (``adapters.common.config.ARG_TO_KEY`` maps them).
A flag the framework has and these parsers do not is argparse's error naming it, so a
command line never runs with a flag silently dropped.
"""

from __future__ import annotations

import argparse
from typing import Any


def base_parser(
    framework: str, *, actor_gpus_per_node: int, data_source_path: str, rollout_function_path: str
) -> tuple[argparse.ArgumentParser, dict[str, argparse._ArgumentGroup]]:
    """The flags both drivers declare, with the framework's names and defaults; the
    argument groups by name (``cluster``, ``rollout``, ``checkpoints``, ...) for the
    framework's own flags."""
    owner = "slime's" if framework == "slime" else "miles'"
    ap = argparse.ArgumentParser(
        prog=f"python -m adapters.{framework}.train",
        description=f"{owner} RL loop with Titan's Megatron base as the training backend",
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

    c = ap.add_argument_group(f"cluster ({owner} names)")
    c.add_argument("--actor-num-nodes", type=int, default=1)
    c.add_argument("--actor-num-gpus-per-node", type=int, default=actor_gpus_per_node)
    c.add_argument("--rollout-num-gpus", type=int, default=None)
    c.add_argument("--rollout-num-gpus-per-engine", type=int, default=1)
    c.add_argument("--num-gpus-per-node", type=int, default=8)
    c.add_argument("--colocate", action="store_true", default=False)

    d = ap.add_argument_group(f"data and rollout ({owner} names)")
    d.add_argument(
        "--hf-checkpoint",
        default=None,
        help="HF directory the engines start from (default: the Titan policy, exported)",
    )
    d.add_argument("--data-source-path", default=data_source_path)
    d.add_argument("--disable-rollout-global-dataset", action="store_false",
                   dest="rollout_global_dataset", default=True)  # fmt: skip
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
    d.add_argument("--rollout-function-path", default=rollout_function_path)
    d.add_argument("--eval-function-path", default=None)
    d.add_argument("--custom-rm-path", default=None)
    d.add_argument("--group-rm", action="store_true", default=False)
    d.add_argument("--eval-interval", type=int, default=None)
    d.add_argument("--eval-temperature", type=float, default=None)
    d.add_argument("--eval-max-response-len", type=int, default=None)

    a = ap.add_argument_group(f"algorithm ({owner} names; unset: the Titan YAML's value)")
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

    o = ap.add_argument_group(f"training ({owner} / Megatron's names; unset: the Titan YAML's)")
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

    k = ap.add_argument_group(f"checkpoints and weight updates ({owner} names)")
    k.add_argument("--load", default=None, help="a Titan checkpoint folder to start from")
    k.add_argument("--save", default=None, help="where checkpoints go (and resume from)")
    k.add_argument("--save-interval", type=int, default=None)
    k.add_argument("--update-weight-disk-dir", default=None)
    return ap, {"titan": t, "cluster": c, "rollout": d, "algorithm": a, "training": o,
                "checkpoints": k}  # fmt: skip


def finish(
    ap: argparse.ArgumentParser, args: argparse.Namespace, defaults: dict[str, Any]
) -> argparse.Namespace:
    """The framework's defaults for what it reads but no flag sets, and the checks both
    parsers make (each error names the flag)."""
    for key, value in defaults.items():
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
    if args.custom_rm_path is None and args.rollout_function_path == ap.get_default(
        "rollout_function_path"
    ):
        ap.error(
            "--custom-rm-path is needed to score the rollouts (e.g. "
            "adapters.slime.rewards.exact_match or adapters.slime.rewards.math_verify): the "
            "framework's rm_hub is not loaded by this driver"
        )
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    return args
