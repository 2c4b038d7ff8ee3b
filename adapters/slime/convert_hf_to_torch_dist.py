"""``python -m adapters.slime.convert_hf_to_torch_dist <MODEL_ARGS> --hf-checkpoint HF --save DIR``

slime's ``tools/convert_hf_to_torch_dist.py`` for the Titan backend, with its command line:
Megatron-LM's model flags (as slime's ``scripts/models/*.sh`` give them), ``--hf-checkpoint``
and ``--save``. It reads the HF checkpoint into Titan's megatron-core model (Titan's HF
mapping, ``titan_core.models.hf``) and writes a megatron-core ``torch_dist`` checkpoint laid
out as slime's tool lays it (``release/`` and ``latest_checkpointed_iteration.txt`` holding
``release``: weights to start from, read by Megatron-LM as iteration 0), which a slime run on
Titan reads with ``--ref-load``. The model
flags are checked against the HF ``config.json``: a disagreement is an error naming both.
The checkpoint is saved with global shapes, so it loads at any TP / PP / EP layout; the
parallel sizes given here do not change what is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from adapters.common.arguments import given_dests
from adapters.common.flag_table import FLAG_TABLE, NoEffect, Refused
from adapters.common.megatron_flags import MEGATRON_FLAGS
from titan_core.config import ConfigError

_SECTIONS = ("model", "moe", "parallel", "precision", "kernels")


def build_parser(*, suppress_defaults: bool = False) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m adapters.slime.convert_hf_to_torch_dist",
        description="HF checkpoint -> megatron-core torch_dist checkpoint (slime's tool)",
        allow_abbrev=False,
    )
    default = argparse.SUPPRESS if suppress_defaults else None
    ap.add_argument("--hf-checkpoint", required=not suppress_defaults, default=default)
    ap.add_argument("--save", required=not suppress_defaults, default=default)
    ap.add_argument("--custom-model-provider-path", default=default)
    ap.add_argument("--allgather-cp", action="store_true",
                    default=argparse.SUPPRESS if suppress_defaults else False)  # fmt: skip
    ap.add_argument("--padded-vocab-size", type=int, default=default)
    for spec in MEGATRON_FLAGS:
        if spec.section in _SECTIONS:
            spec.add_to(ap, suppress_default=suppress_defaults)
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    given, _ = build_parser(suppress_defaults=True).parse_known_args(argv)
    args.titan_given = sorted(vars(given))
    if args.custom_model_provider_path:
        ap.error("--custom-model-provider-path: Titan builds its model from the HF config")
    for dest in args.titan_given:
        entry = FLAG_TABLE.get(dest)
        if isinstance(entry, Refused):
            ap.error(f"--{dest.replace('_', '-')} is not supported by the Titan backend: "
                     f"{entry.instead}")  # fmt: skip
    return args


def convert(args: Any) -> Path:
    """Read ``--hf-checkpoint`` into Titan's model, check the model flags against it and
    write the torch_dist checkpoint to ``--save``; returns the iteration folder."""
    import torch.distributed as dist

    from titan_core.accelerator.megatron_compat import import_megatron

    import_megatron()  # before the trainer's modules (CPU: uncompiled)
    from adapters.common.config import check_against_hf, flag_overrides
    from titan_core.checkpoint.dist import RELEASE, save_checkpoint
    from titan_core.models.hf import model_config_from_hf
    from titan_rl.config import GRPOConfig
    from titan_rl.trainer.policy import PolicyTrainer

    hf = Path(args.hf_checkpoint)
    if not (hf / "config.json").is_file():
        raise ConfigError(f"--hf-checkpoint {hf} has no config.json; give an HF model directory")
    model = model_config_from_hf(hf).model_dump()
    check_against_hf(hf, model, flag_overrides(args))
    cfg = GRPOConfig.model_validate({
        "policy": {"format": "hf", "load": str(hf.resolve())},
        "model": {k: v for k, v in model.items() if v is not None},
        "data": {"tokenizer_type": "hf", "tokenizer_model": str(hf)}
        if (hf / "tokenizer.json").is_file() else {},
        "run": {"dir": str(Path(args.save).resolve() / ".convert")},
    })  # fmt: skip
    trainer = PolicyTrainer(cfg, world_size=1)
    try:
        path = save_checkpoint(
            args.save, RELEASE, trainer.model, None,
            {"step": 0, "source": f"hf:{hf.resolve()}"},
        )  # fmt: skip
    finally:
        trainer.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ignored = [d for d in given_dests(args) if isinstance(FLAG_TABLE.get(d), NoEffect)]
    for dest in ignored:
        print(f"no effect here: --{dest.replace('_', '-')}: {FLAG_TABLE[dest].describe()}")
    try:
        path = convert(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (megatron-core torch_dist; --ref-load {args.save})", flush=True)
    return 0


if __name__ == "__main__":
    from titan_core.process_exit import exit_process

    exit_process(main())
