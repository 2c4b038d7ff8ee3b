"""The Titan config of a slime or miles run: ``TITAN_CONFIG`` plus the framework's own args.

A slime / miles run may name one Titan file, a ``titan_rl.grpo`` YAML (``examples/math.yaml``
works as it is), through ``TITAN_CONFIG`` (or ``--titan-config``, with ``--titan-override
key.sub=value ...``): it carries Titan's switches (``train.fp8``,
``model.moe_token_dispatcher_type``, ``parallel.overlap_moe_expert_parallel_comm``,
``train.offload_modules``, ``sync.*``, ...) and, for a run without a checkpoint of its own, the
model and data. Then, in this order:

1. ``--hf-checkpoint`` with a ``config.json``: the model section is that model's
   (``model_config_from_hf``), and its tokenizer reads the prompts and pads the batches.
2. Every flag given on the command line that the flag table (``adapters.common.flag_table``)
   maps to a Titan key overrides it (a flag left at its default never does; under the
   framework's own parser, "given" is "differs from the framework's default"). A Megatron
   model flag that disagrees with the ``--hf-checkpoint`` config is an error naming both.
3. Where the policy starts: the newest checkpoint in ``--load`` (a resume), else
   ``--ref-load`` (slime's fresh run: ``--load`` and ``--save`` one empty folder), else
   ``--hf-checkpoint``'s weights, else the YAML's ``policy``.

Each value goes through Titan's typed config: a bad one is a :class:`ConfigError` naming the
flag and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig

#: environment variable naming the Titan YAML of a slime / miles run
CONFIG_ENV = "TITAN_CONFIG"


def config_path(args: Any) -> str | None:
    """``args.titan_config`` if the driver set it, else ``$TITAN_CONFIG``, else None."""
    return getattr(args, "titan_config", None) or os.environ.get(CONFIG_ENV) or None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def flag_overrides(args: Any) -> dict[str, tuple[str, Any]]:
    """Titan key -> (flag, value) for every flag given that the flag table maps to a key."""
    from adapters.common.arguments import given_dests
    from adapters.common.flag_table import FLAG_TABLE, Honoured

    given = given_dests(args)
    out: dict[str, tuple[str, Any]] = {}
    for dest in sorted(FLAG_TABLE):
        entry = FLAG_TABLE[dest]
        if not isinstance(entry, Honoured) or entry.key is None or not hasattr(args, dest):
            continue
        # a flag left at its default: the YAML holds; without a YAML, the framework's
        # default holds over Titan's (the model's shape comes from flags or the HF config)
        if dest not in given and (config_path(args) or entry.key.startswith("model.")):
            continue
        value = getattr(args, dest)
        try:
            value = entry.convert(value) if entry.convert else value
        except ValueError as e:
            raise ConfigError(f"{_flag(dest)}: {e}") from None
        if value is not None:
            out[entry.key] = (_flag(dest) if dest in given else f"{_flag(dest)} (default)", value)
    # --lr without --min-lr: Megatron's min_lr default (0), not a YAML floor above the lr
    if "train.lr" in out and "min_lr" not in given:
        out["train.min_lr"] = ("--min-lr (Megatron's default with --lr)", 0.0)
    # Megatron-LM turns sequence parallelism off at TP 1 (nothing to split over)
    tp = out.get("parallel.tensor_model_parallel_size", ("", 1))[1]
    if tp == 1 and out.get("parallel.sequence_parallel", ("", False))[1]:
        del out["parallel.sequence_parallel"]
    # Megatron: --num-query-groups counts only with --group-query-attention
    if "num_query_groups" in given and getattr(args, "group_query_attention", False):
        out["model.num_query_groups"] = ("--num-query-groups", args.num_query_groups)
    return out


#: the model fields an HF checkpoint fixes (its architecture); the others (dropout, aux-loss
#: coefficient, dispatcher, ...) are training choices the flags make
ARCHITECTURE = frozenset(
    [
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "normalization",
        "norm_epsilon",
        "position_embedding_type",
        "rotary_base",
        "swiglu",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "untie_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size",
        "moe_layer_freq",
    ]
)


def check_against_hf(hf: Path, model: dict[str, Any], flags: dict[str, tuple[str, Any]]) -> None:
    """A Megatron model flag that disagrees with the HF checkpoint's architecture: an error
    naming the flag, its value and the checkpoint's."""
    for key, (flag, value) in flags.items():
        field = key.removeprefix("model.")
        if key.startswith("model.") and field in ARCHITECTURE and not _agree(model[field], value):
            raise ConfigError(
                f"{flag} {value} disagrees with --hf-checkpoint {hf}: its config.json gives "
                f"model.{field}={model[field]!r}; fix the flag or the checkpoint"
            )


def _hf_config(args: Any) -> Path | None:
    hf = getattr(args, "hf_checkpoint", None)
    if hf and (Path(hf) / "config.json").is_file():
        return Path(hf)
    return None


def _has_checkpoint(path: str | None) -> bool:
    from titan_core.checkpoint.dist import latest_iteration

    return bool(path) and latest_iteration(path) is not None


def titan_config_from_args(args: Any) -> GRPOConfig:
    """The run's :class:`GRPOConfig` (see the module docstring for the order)."""
    path = config_path(args)
    if path is not None and not Path(path).is_file():
        raise ConfigError(
            f"{CONFIG_ENV}={path}: no such file; point it at a titan_rl.grpo YAML "
            "(e.g. examples/math.yaml)"
        )
    overrides: list[str] = []
    hf = _hf_config(args)
    flags = flag_overrides(args)
    if hf is not None:
        from titan_core.models.hf import model_config_from_hf

        model = model_config_from_hf(hf).model_dump()
        check_against_hf(hf, model, flags)
        overrides += [f"model.{k}={_yaml(v)}" for k, v in model.items() if v is not None]
        if (hf / "tokenizer.json").is_file():
            overrides += ["data.tokenizer_type=hf", f"data.tokenizer_model={hf}"]
    overrides += [f"{key}={_yaml(value)}" for key, (_, value) in flags.items()]
    overrides += _data(args)
    overrides += _run_length(args)
    overrides += _policy(args, hf)
    overrides += list(getattr(args, "titan_overrides", None) or [])
    named = [f"{flag} -> {key}" for key, (flag, _) in flags.items() if "(default" not in flag]
    try:
        cfg = load_config(GRPOConfig, path, overrides)
    except ConfigError as e:
        if not named:
            raise
        raise ConfigError(f"{e}\n(flags applied on top: {'; '.join(named)})") from None
    _check_mooncake_agents(cfg)
    return cfg


def _check_mooncake_agents(cfg: GRPOConfig) -> None:
    """``sync.transport=mooncake`` needs its agents named here: the GRPO job starts them
    beside its engines when ``sync.mooncake.agents`` is empty, the adapters do not (the
    framework may own the engines: miles' ``--rollout-external``)."""
    if cfg.sync.transport == "mooncake" and not cfg.sync.mooncake.agents:
        raise ConfigError(
            "sync.transport=mooncake (miles' --update-weight-transfer-mode p2p) needs "
            "sync.mooncake.agents in the slime / miles adapters: they start no Mooncake agent "
            "beside the engines (only python -m titan_rl.grpo does); start `python -m "
            "titan_rl.sync.mooncake_agent --engine-url ...` beside each engine and list their "
            "URLs in the engines' order (--titan-override sync.mooncake.agents=[...]), or "
            "choose another transport"
        )


def _data(args: Any) -> list[str]:
    """``--prompt-data`` and its keys as the Titan data section (what Titan's prompt source
    reads where the framework's own cannot run)."""
    path = getattr(args, "prompt_data", None)
    if not path:
        return []
    kind = "parquet" if str(path).endswith(".parquet") else "jsonl"
    out = [f"data.type={kind}", f"data.path={path}", f"data.prompt_key={args.input_key}",
           f"data.apply_chat_template={_yaml(bool(args.apply_chat_template))}"]  # fmt: skip
    if args.label_key:
        out.append(f"data.label_key={args.label_key}")
    return out


def _run_length(args: Any) -> list[str]:
    """``--num-rollout`` as ``run.num_steps``: the LR schedule's horizon is the run's
    rollouts, as slime's and miles' (``train_iters`` from ``--num-rollout``)."""
    num_rollout = getattr(args, "num_rollout", None)
    return [] if num_rollout is None else [f"run.num_steps={num_rollout}"]


def rl_checkpoint(path: str | None) -> bool:
    """Whether ``path``'s newest checkpoint was written by a slime / miles run on Titan (its
    common state names the rollout it followed): a resume point. Any other checkpoint (a
    converted HF model, a pretrained base) is weights to start from, as Megatron-LM treats
    a release checkpoint."""
    from titan_core.checkpoint.dist import iteration_dir, latest_iteration

    it = latest_iteration(path) if path else None
    if it is None:
        return False
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(iteration_dir(path, it)))
    return "rollout_id" in common or "rollout_id" in (common.get("common") or {})


def resume_dir(args: Any) -> str | None:
    """Where a run resumes from: ``--load`` (slime's and Megatron-LM's resume folder) when
    its newest checkpoint is an RL run's, else ``--save`` when it holds one (a run restarted
    with the same command), else None (a fresh run)."""
    for path in (getattr(args, "load", None), getattr(args, "save", None)):
        if rl_checkpoint(path):
            return str(path)
    return None


def _policy(args: Any, hf: Path | None) -> list[str]:
    """Where the policy's weights (and the reference model's) come from before any resume:
    ``--ref-load``, else ``--load`` (a checkpoint to start from, or the one resumed), else
    the ``--hf-checkpoint`` weights, else the YAML's ``policy``."""
    load, ref = getattr(args, "load", None), getattr(args, "ref_load", None)
    if ref:
        if not _has_checkpoint(ref):
            raise ConfigError(
                f"--ref-load {ref} holds no checkpoint (no latest_checkpointed_iteration.txt "
                "naming a complete iteration); make one with python -m "
                "adapters.slime.convert_hf_to_torch_dist --hf-checkpoint HF --save DIR"
            )
        return ["policy.format=titan", f"policy.load={Path(ref).resolve()}"]
    if _has_checkpoint(load):
        return ["policy.format=titan", f"policy.load={Path(load).resolve()}"]
    if hf is not None:
        return ["policy.format=hf", f"policy.load={hf.resolve()}"]
    return []


def _agree(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a == b
    if isinstance(a, float) or isinstance(b, float):
        return float(a) == float(b)
    return a == b


def _yaml(value: Any) -> str:
    """A Python value as an override's YAML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value)


def mirror_config(args: Any, cfg: GRPOConfig) -> None:
    """Put the resolved Titan values back on ``args`` under the flags' names, so slime's and
    miles' own code reading ``args`` (placement, DP schedule) sees the values Titan runs."""
    from adapters.common.flag_table import FLAG_TABLE, Honoured

    for dest, entry in FLAG_TABLE.items():
        if isinstance(entry, Honoured) and entry.key and entry.convert is None:
            section, _, field = entry.key.partition(".")
            if hasattr(args, dest) and "." not in field:
                setattr(args, dest, getattr(getattr(cfg, section), field))
