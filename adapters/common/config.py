"""The Titan config of a slime or miles run: ``TITAN_CONFIG`` plus the framework's own args.

A slime / miles run names one Titan file, a ``titan_rl.grpo`` YAML (``examples/math.yaml``
works as it is), through the environment variable ``TITAN_CONFIG`` (or ``--titan-config``
of ``python -m adapters.slime.train``, with ``--titan-override key.sub=value ...``). It carries what slime's Megatron arguments would:
the model (``model.*``), the layout (``parallel.*``), Titan's switches (``train.fp8``,
``train.fp8_recipe``, ``model.moe_token_dispatcher_type``,
``parallel.overlap_moe_expert_parallel_comm``, ``train.offload_modules``, ...), the
weight-sync transport (``sync.*``) and where the policy starts (``policy.*``). Then the
framework's arguments in :data:`ARG_TO_KEY` that are set override their Titan keys, so
``--lr`` or ``--eps-clip`` mean what they mean in slime. Each value goes through Titan's
typed config: a bad one is a :class:`ConfigError` naming the argument and the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from titan_core.config import ConfigError, load_config
from titan_rl.config import GRPOConfig

#: environment variable naming the Titan YAML of a slime / miles run
CONFIG_ENV = "TITAN_CONFIG"

#: slime / miles argument (``args.<name>``) -> Titan key; applied when the argument is set
ARG_TO_KEY: dict[str, str] = {
    "lr": "train.lr",
    "min_lr": "train.min_lr",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "clip_grad": "train.clip_grad",
    "micro_batch_size": "train.micro_batch_size",
    "seed": "train.seed",
    "tensor_model_parallel_size": "parallel.tensor_model_parallel_size",
    "pipeline_model_parallel_size": "parallel.pipeline_model_parallel_size",
    "context_parallel_size": "parallel.context_parallel_size",
    "expert_model_parallel_size": "parallel.expert_model_parallel_size",
    "rollout_batch_size": "rollout.prompts_per_step",
    "n_samples_per_prompt": "rollout.n_samples_per_prompt",
    "rollout_max_response_len": "rollout.max_response_len",
    "advantage_estimator": "algo.advantage_estimator",
    "eps_clip": "algo.eps_clip",
    "eps_clip_high": "algo.eps_clip_high",
    "eps_clip_c": "algo.eps_clip_c",
    "use_kl_loss": "algo.use_kl_loss",
    "kl_loss_coef": "algo.kl_loss_coef",
    "kl_loss_type": "algo.kl_loss_type",
    "entropy_coef": "algo.entropy_coef",
    "use_tis": "algo.use_tis",
}

#: advantage estimators whose advantage is the framework's post-processed reward on every
#: response token (slime / miles normalize rewards per group before training); the others
#: need the framework's train-side returns or a critic, which this backend does not run.
SUPPORTED_ESTIMATORS = ("grpo", "gspo")


def config_path(args: Any) -> str | None:
    """``args.titan_config`` if the driver set it, else ``$TITAN_CONFIG``, else None."""
    return getattr(args, "titan_config", None) or os.environ.get(CONFIG_ENV) or None


def _arg_value(args: Any, name: str) -> Any:
    value = getattr(args, name, None)
    if name == "use_tis" and value is False:
        return None  # slime's flag defaults to False; Titan's None means "off unless async"
    return value


def titan_config_from_args(args: Any) -> GRPOConfig:
    """The run's :class:`GRPOConfig`: ``TITAN_CONFIG`` (or Titan's defaults) with the
    framework's arguments of :data:`ARG_TO_KEY` on top."""
    path = config_path(args)
    if path is not None and not Path(path).is_file():
        raise ConfigError(
            f"{CONFIG_ENV}={path}: no such file; point it at a titan_rl.grpo YAML "
            "(e.g. examples/math.yaml)"
        )
    overrides: list[str] = list(getattr(args, "titan_overrides", None) or [])
    named: list[str] = []
    for arg, key in ARG_TO_KEY.items():
        value = _arg_value(args, arg)
        if value is None:
            continue
        if arg == "advantage_estimator" and value not in SUPPORTED_ESTIMATORS:
            raise ConfigError(
                f"--advantage-estimator {value}: the Titan backend trains with "
                f"{', '.join(SUPPORTED_ESTIMATORS)} (the reward, normalized per group by the "
                "rollout side, is the advantage of every response token); use one of them"
            )
        overrides.append(f"{key}={_yaml(value)}")
        named.append(f"--{arg.replace('_', '-')} -> {key}")
    kl_coef = getattr(args, "kl_coef", 0.0) or 0.0
    if kl_coef:
        raise ConfigError(
            f"--kl-coef {kl_coef}: a KL penalty in the reward is not supported by the Titan "
            "backend; use --use-kl-loss with --kl-loss-coef instead"
        )
    load = getattr(args, "load", None)
    if load:
        overrides += ["policy.format=titan", f"policy.load={load}"]
    try:
        return load_config(GRPOConfig, path, overrides)
    except ConfigError as e:
        if not named:
            raise
        raise ConfigError(f"{e}\n(arguments applied on top: {'; '.join(named)})") from None


def _yaml(value: Any) -> str:
    """A Python value as an override's YAML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    return str(value)
