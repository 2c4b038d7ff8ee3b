"""HF <-> megatron-core weight mapping for Llama, Qwen2, Qwen3 and Qwen3-MoE.

The names below come from :mod:`titan_core.models.hf.convert`, imported on first use: a
process that needs only the name tables (:mod:`titan_core.models.hf.families`, the built-in
engine's check of a model type) does not load the converter and the configs it imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from titan_core.models.hf.convert import (
        HFBridge,
        SendRole,
        export_hf_weights,
        load_hf_weights,
        model_config_from_hf,
        read_hf_config,
    )

__all__ = [
    "HFBridge",
    "SendRole",
    "export_hf_weights",
    "load_hf_weights",
    "model_config_from_hf",
    "read_hf_config",
]


def __getattr__(name: str) -> Any:
    """The converter's names (PEP 562), imported when first asked for."""
    if name in __all__:
        from titan_core.models.hf import convert

        return getattr(convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
