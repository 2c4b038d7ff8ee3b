"""miles' command line, for ``python -m adapters.miles.train``: every flag miles' installed
parser declares, with miles' defaults (read from its source: ``adapters.common.arguments``
says why its parser cannot run here), plus the Megatron-LM flags miles' scripts pass, each
classified by the flag table.

miles' rollout function and data sources import ``sglang`` at the top: left at their
defaults, the rollout goes through ``adapters.miles.generate.generate_rollout`` and the
prompts through ``adapters.miles.data_source.TitanPromptSource`` (``--prompt-data`` with
``--input-key`` / ``--label-key`` / ``--apply-chat-template`` / ``--rollout-shuffle``, else
the Titan YAML's data section).

Weight transfer: miles' ``--colocate`` (tensor update) and ``--update-weight-transfer-mode``
(``broadcast`` / ``p2p`` / ``disk-delta``), when given, choose Titan's ``sync.transport``
(``tensor`` / ``distributed`` / ``mooncake`` / ``disk``); otherwise the YAML's ``sync`` holds.

What miles' own validation derives is derived here by the same rules: ``--use-fault-tolerance``
without ``--ft-components`` is its ``rollout`` component; ``--dump-details DIR`` names the
dump paths miles' functions write (``save_debug_rollout_data``, ``save_debug_train_data``,
``save_debug_trajectory_data``, ``save_debug_event_data``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from adapters.common.arguments import build_parser as _build_parser
from adapters.common.arguments import driver_defaults, finish, parse

#: miles' transfer mode -> Titan's sync.transport
TRANSFER_MODE_TO_TRANSPORT = {"broadcast": "distributed", "p2p": "mooncake", "disk-delta": "disk"}
ROLLOUT_FUNCTION = "adapters.miles.generate.generate_rollout"
DATA_SOURCE = "adapters.miles.data_source.TitanPromptSource"


def build_parser() -> argparse.ArgumentParser:
    return _build_parser("miles")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """miles' args namespace: every flag given checked against the flag table, miles'
    defaults for the rest, and what miles' validation derives (errors name the flag)."""
    ap = build_parser()
    args = parse("miles", argv)
    driver_defaults(args, ROLLOUT_FUNCTION, DATA_SOURCE, with_prompt_data=True)
    args = finish(ap, args)
    derive_miles_rules(args)
    if args.rollout_external and not args.rollout_external_engine_addrs:
        ap.error("--rollout-external needs --rollout-external-engine-addrs host:port ...")
    given = set(args.titan_given)
    mode = args.update_weight_transfer_mode if "update_weight_transfer_mode" in given else None
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


def derive_miles_rules(args: argparse.Namespace) -> None:
    """miles' derivations (``miles.utils.arguments``, which cannot be imported here) of the
    fault-tolerance components and the ``--dump-details`` paths."""
    if not args.use_fault_tolerance:
        args.ft_components = []
    elif args.ft_components is None:
        args.ft_components = ["rollout"]
    if args.dump_details is not None:
        d = args.dump_details = str(Path(args.dump_details).resolve())  # Ray workers move
        args.save_debug_rollout_data = f"{d}/rollout_data/{{rollout_id}}.pt"
        args.save_debug_train_data = f"{d}/train_data/{{rollout_id}}_{{rank}}.pt"
        args.save_debug_trajectory_data = f"{d}/trajectory/{{rollout_id}}.jsonl"
        args.save_debug_event_data = f"{d}/events"
