"""The command line of ``python -m adapters.slime.train`` and ``adapters.miles.train``:
the framework's own flags, read from its installed parser source
(:mod:`adapters.common.peer_flags`), with its names and defaults, plus the Megatron-LM flags
its scripts pass (:mod:`adapters.common.megatron_flags`) and three of Titan's
(``--titan-config``, ``--titan-override``, ``--metrics-dir``).

Every flag given on the command line is checked against the flag table
(:mod:`adapters.common.flag_table`) at parse time: a refused flag (or a refused value of an
honoured one) exits 2 naming it and what to use instead; a flag with no effect here is
named, with the reason, in one start-up line; the honoured ones act. ``args.titan_given``
lists the flags given on the command line: only those override the Titan YAML, a flag left
at its default never does.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from adapters.common.flag_table import Honoured, NoEffect, Refused, entry_for
from adapters.common.megatron_flags import MEGATRON_FLAGS
from adapters.common.peer_flags import FlagSpec, is_generated, peer_flags

#: Titan's own flags, in their own argument group
TITAN_DESTS = ("titan_config", "titan_overrides", "metrics_dir")


def framework_flags(framework: str) -> list[FlagSpec]:
    """The framework's flags, then the Megatron-LM flags it does not declare itself."""
    own = list(peer_flags(framework))
    names = {o for s in own for o in s.options}
    return own + [s for s in MEGATRON_FLAGS if not names.intersection(s.options)]


def build_parser(framework: str, *, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """The driver's parser: Titan's flags and every flag of :func:`framework_flags`, in the
    framework's argument groups. ``suppress_defaults``: a flag not given stays unset (what
    :func:`given_dests` reads)."""
    owner = "slime's" if framework == "slime" else "miles'"
    ap = argparse.ArgumentParser(
        prog=f"python -m adapters.{framework}.train",
        description=f"{owner} RL loop with Titan's Megatron base as the training backend",
        allow_abbrev=False,
    )
    default = argparse.SUPPRESS if suppress_defaults else None
    t = ap.add_argument_group("Titan")
    t.add_argument("--titan-config", default=default,
                   help="Titan YAML (titan_rl.grpo's format): model, layout, switches, sync; "
                        "default $TITAN_CONFIG")  # fmt: skip
    t.add_argument("--titan-override", dest="titan_overrides", nargs="+", action="extend",
                   default=argparse.SUPPRESS if suppress_defaults else [], metavar="KEY=VALUE",
                   help="Titan config overrides (key.sub=value), e.g. sync.check_every=1")  # fmt: skip
    t.add_argument("--metrics-dir", default=default,
                   help="where metrics.jsonl and reward.png go (default: the Titan run.dir)")  # fmt: skip
    groups: dict[str, Any] = {}
    for spec in framework_flags(framework):
        section = spec.section or "other"
        if section not in groups:
            groups[section] = ap.add_argument_group(f"{section} ({spec.source.split(':')[0]})")
        spec.add_to(groups[section], suppress_default=suppress_defaults)
    return ap


def _generated(ap: argparse.ArgumentParser, unknown: list[str]) -> dict[str, list[str]]:
    """``--sglang-*`` / ``--router-*`` flags (generated from sglang's and sglang-router's
    argument classes, absent here) with their values; anything else unknown is argparse's
    error naming it."""
    out: dict[str, list[str]] = {}
    flag: str | None = None
    for token in unknown:
        if token.startswith("--"):
            name = token.split("=", 1)[0]
            if not is_generated(name):
                ap.error(f"unrecognized arguments: {token}")
            flag = name
            out[flag] = [token.split("=", 1)[1]] if "=" in token else []
        elif flag is None:
            ap.error(f"unrecognized arguments: {token}")
        else:
            out[flag].append(token)
    return out


def parse(framework: str, argv: list[str] | None) -> argparse.Namespace:
    """The framework's args namespace from ``argv`` (default ``sys.argv[1:]``), each given
    flag checked against the flag table (refusals exit 2 naming the flag)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = build_parser(framework)
    args, unknown = ap.parse_known_args(argv)
    args.titan_generated_flags = _generated(ap, unknown)
    args.titan_framework = framework
    given, _ = build_parser(framework, suppress_defaults=True).parse_known_args(argv)
    args.titan_given = sorted(k for k in vars(given) if k not in TITAN_DESTS)
    flags = {s.dest: s.name for s in framework_flags(framework)}
    lines: list[str] = []
    for dest in args.titan_given:
        _check(ap, dest, flags[dest], getattr(args, dest), lines, framework)
    for flag in args.titan_generated_flags:
        _check(ap, flag.lstrip("-").replace("-", "_"), flag, None, lines, framework)
    args.titan_no_effect = lines
    return args


def _check(
    ap: argparse.ArgumentParser,
    dest: str,
    flag: str,
    value: Any,
    lines: list[str],
    framework: str | None = None,
) -> None:
    entry = entry_for(dest, flag, framework)
    if entry is None:
        ap.error(f"{flag}: not classified by the Titan backend's flag table "
                 "(adapters/common/flag_table.py); drop it or add it there")  # fmt: skip
    elif isinstance(entry, Refused):
        ap.error(f"{flag} is not supported by the Titan backend: {entry.instead}")
    elif isinstance(entry, NoEffect):
        lines.append(f"{flag}: {entry.reason}")
    elif isinstance(entry, Honoured) and entry.refuses(value):
        ap.error(f"{flag} {value}: {entry.refuse_why}")


def defaults(framework: str) -> dict[str, Any]:
    """Every flag's default (what a flag not given on the command line holds)."""
    return vars(build_parser(framework).parse_known_args([])[0])


def given_dests(args: Any, framework: str = "slime") -> set[str]:
    """The flags given on the command line: ``args.titan_given`` where this driver parsed
    them; under the framework's own parser (its ``args`` carry no such list) those whose
    value differs from the framework's default."""
    if hasattr(args, "titan_given"):
        return set(args.titan_given)
    base = defaults(framework)
    return {k for k, v in vars(args).items() if k in base and base[k] != v}


def driver_defaults(
    args: argparse.Namespace, rollout_function: str, data_source: str, *, with_prompt_data: bool
) -> None:
    """The framework's rollout function and data source where their defaults import sglang:
    the adapter's, unless the flag is given (``with_prompt_data``: the data source also
    under ``--prompt-data``); then a way to score the rollouts is required."""
    given = set(args.titan_given)
    if "rollout_function_path" not in given:
        args.rollout_function_path = rollout_function
    if "data_source_path" not in given and (with_prompt_data or args.prompt_data is None):
        args.data_source_path = data_source
    if (
        args.custom_rm_path is None
        and args.rm_type is None
        and (args.rollout_function_path == rollout_function)
    ):
        build_parser(args.titan_framework).error(
            "set --rm-type (the framework's rm_hub: deepscaler, dapo, math, f1, remote_rm, ...) "
            "or --custom-rm-path to score the rollouts"
        )


def _on_cpu() -> bool:
    from titan_core.accelerator import get_accelerator

    return get_accelerator().device_type == "cpu"


def finish(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """What slime's and miles' own argument validation derives (each error names the flag),
    including the attributes their code reads that no flag sets."""
    args.rollout_external = bool(getattr(args, "rollout_external", False)) or (
        args.rollout_external_engine_addrs is not None
    )
    args.use_critic = args.advantage_estimator == "ppo"
    if "actor_num_gpus_per_node" not in args.titan_given and _on_cpu():
        # slime's / miles' default (8) counts GPUs; a CPU machine has none to count
        args.actor_num_gpus_per_node = 1
        args.titan_no_effect.append(
            "--actor-num-gpus-per-node (default 8): one trainer rank on a CPU machine unless "
            "the flag is given"
        )
    if args.eval_reward_key is None:  # slime's and miles' rule
        args.eval_reward_key = args.reward_key
    args.remove_sample = False
    args.multi_lora = False
    args.sglang_speculative_algorithm = None
    if args.custom_config_path:  # slime's rule: the YAML's keys set on args
        import yaml

        with open(args.custom_config_path) as f:
            for key, value in (yaml.safe_load(f) or {}).items():
                setattr(args, key, value)
    if args.offload:
        args.offload_train = args.offload_rollout = True
    if args.colocate:  # slime / miles: colocation always offloads both sides
        args.offload_train = True if args.offload_train is None else args.offload_train
        args.offload_rollout = True if args.offload_rollout is None else args.offload_rollout
    args.offload_train = bool(args.offload_train)
    args.offload_rollout = bool(args.offload_rollout)
    if args.rollout_num_gpus is None:
        args.rollout_num_gpus = args.actor_num_nodes * args.actor_num_gpus_per_node
    if args.rollout_num_gpus % args.rollout_num_gpus_per_engine:
        ap.error("--rollout-num-gpus must be a multiple of --rollout-num-gpus-per-engine")
    if args.rollout_batch_size is None:
        ap.error("--rollout-batch-size is required")
    if args.num_rollout is None and args.num_epoch is None:
        ap.error("set --num-rollout (or --num-epoch with --prompt-data)")
    per_rollout = args.rollout_batch_size * args.n_samples_per_prompt
    if args.num_steps_per_rollout is not None and args.global_batch_size is None:
        args.global_batch_size = per_rollout // args.num_steps_per_rollout
    if args.global_batch_size is None:
        args.global_batch_size = per_rollout
    if per_rollout % args.global_batch_size:
        ap.error(
            f"--global-batch-size {args.global_batch_size} must divide --rollout-batch-size x "
            f"--n-samples-per-prompt ({per_rollout})"
        )
    if args.eval_function_path is None:
        args.eval_function_path = args.rollout_function_path
    if args.eval_prompt_data is not None and len(args.eval_prompt_data) % 2:
        ap.error("--eval-prompt-data takes NAME PATH pairs")
    if args.use_dynamic_batch_size and args.max_tokens_per_gpu is None:
        ap.error("--use-dynamic-batch-size needs --max-tokens-per-gpu")
    return args
