"""Which layer implementation a run builds: Transformer Engine's or megatron-core's local
layers. Kept apart from :mod:`titan_core.models.gpt` so that a driver can ask before it
pays for importing megatron-core's model code (seconds on a CPU)."""

from __future__ import annotations

import importlib.util

from titan_core.accelerator import Accelerator
from titan_core.config.loader import ConfigError
from titan_core.config.pretrain import PretrainConfig


def use_transformer_engine(cfg: PretrainConfig, accel: Accelerator) -> bool:
    """True where ``model.transformer_impl`` (auto or transformer_engine) and the machine
    (a GPU with Transformer Engine installed) both allow TE's layers."""
    impl = cfg.model.transformer_impl
    te_present = accel.device_type != "cpu" and importlib.util.find_spec("transformer_engine")
    if impl == "transformer_engine" and not te_present:
        raise ConfigError(
            "model.transformer_impl=transformer_engine but Transformer Engine is not usable "
            f"here (accelerator {accel.name}); install titan[gpu] on a GPU machine or use local"
        )
    return bool(impl != "local" and te_present)
