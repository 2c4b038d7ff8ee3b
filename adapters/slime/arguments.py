"""slime's command line, for ``python -m adapters.slime.train``: every flag slime's installed
parser declares, with slime's defaults (read from its source: ``adapters.common.arguments``
says why its parser cannot run here), plus the Megatron-LM flags slime's scripts pass,
each classified by the flag table.

Two of slime's defaults name modules that import ``sglang`` at the top
(``--rollout-function-path slime.rollout.sglang_rollout.generate_rollout``); left at their
default, the rollout goes through ``adapters.slime.rollout.generate_rollout`` (the same
rollout over Titan's engines). ``--data-source-path`` left at its default is slime's own
``RolloutDataSourceWithBuffer`` over ``--prompt-data``; without ``--prompt-data``, the
Titan YAML's prompts (``adapters.slime.data_source.TitanPromptSource``).
"""

from __future__ import annotations

import argparse

from adapters.common.arguments import build_parser as _build_parser
from adapters.common.arguments import driver_defaults, finish, parse

#: the rollout function this driver runs when --rollout-function-path is left at slime's
ROLLOUT_FUNCTION = "adapters.slime.rollout.generate_rollout"
#: the data source without --prompt-data
TITAN_DATA_SOURCE = "adapters.slime.data_source.TitanPromptSource"


def build_parser() -> argparse.ArgumentParser:
    return _build_parser("slime")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """slime's args namespace: every flag given checked against the flag table, slime's
    defaults for the rest, and what slime's validation derives (errors name the flag)."""
    args = parse("slime", argv)
    driver_defaults(args, ROLLOUT_FUNCTION, TITAN_DATA_SOURCE, with_prompt_data=False)
    args = finish(build_parser(), args)
    if args.update_weight_transport == "disk" and not args.update_weight_disk_dir:
        build_parser().error("--update-weight-transport disk needs --update-weight-disk-dir")
    return args
